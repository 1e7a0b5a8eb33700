"""torchshard: data-parallel PyTorch training with one flat buffer of weights per device."""

from . import comm as comm  # the comm choices and their state: torchshard.comm
from ._dist import DistInfo, init_distributed
from ._errors import (
    BindError,
    DataError,
    DeviceError,
    LayoutError,
    MeshError,
    PipelineError,
    RankMismatchError,
    TorchShardError,
    TPPlanError,
    UnwrittenBufferError,
)
from ._flat.layout import FlatLayout, ParamSlot, Region
from ._flat.module import FlatParamModule
from ._log import set_log_ranks
from ._parallel.comms import BF16, FP16, AllReduce, CommError, PowerSGD, Star, TopK
from ._parallel.memory import RankMemory, plan_memory
from ._parallel.mesh import Mesh, init_mesh
from ._parallel.modes import FullShard, Replicate, ShardOptimizer
from ._parallel.shards import LocalShards, MemoryStats
from ._parallel.traffic import CommPlan, plan_comm
from ._parallel.trainer import CommStats, DistributedTrainer
from ._pipeline.cost import PipelineMemory, held_microbatches, plan_pipeline_memory
from ._pipeline.hf import hf_stage_forward
from ._pipeline.plan import StagePlan, plan_stages
from ._pipeline.runner import Pipeline
from ._pipeline.split import split_stages
from .data import GlobalBatchSampler

__version__ = "0.1.0"

__all__ = [
    "BF16",
    "FP16",
    "AllReduce",
    "BindError",
    "CommError",
    "CommPlan",
    "CommStats",
    "DataError",
    "DeviceError",
    "DistInfo",
    "DistributedTrainer",
    "FlatLayout",
    "FlatParamModule",
    "FullShard",
    "GlobalBatchSampler",
    "LayoutError",
    "LocalShards",
    "MemoryStats",
    "Mesh",
    "MeshError",
    "ParamSlot",
    "Pipeline",
    "PipelineError",
    "PipelineMemory",
    "PowerSGD",
    "RankMemory",
    "RankMismatchError",
    "Region",
    "Replicate",
    "ShardOptimizer",
    "StagePlan",
    "Star",
    "TPPlanError",
    "TopK",
    "TorchShardError",
    "UnwrittenBufferError",
    "__version__",
    "held_microbatches",
    "hf_stage_forward",
    "init_distributed",
    "init_mesh",
    "plan_comm",
    "plan_memory",
    "plan_pipeline_memory",
    "plan_stages",
    "set_log_ranks",
    "split_stages",
]
