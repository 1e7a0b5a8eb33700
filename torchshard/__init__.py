"""torchshard: data-parallel PyTorch training with one flat buffer of weights per device."""

from ._errors import BindError, LayoutError, TorchShardError
from ._flat_module import FlatParamModule
from ._layout import FlatLayout, ParamSlot

__version__ = "0.1.0"

__all__ = [
    "BindError",
    "FlatLayout",
    "FlatParamModule",
    "LayoutError",
    "ParamSlot",
    "TorchShardError",
    "__version__",
]
