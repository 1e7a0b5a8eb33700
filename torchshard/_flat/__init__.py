"""The flat buffer: the layout (pure metadata), its geometry over ranks, the module that
rebinds parameters as views into one buffer, and transformers interop. Imports nothing
from the parallelism or checkpoint wings."""
