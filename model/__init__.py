"""rnnserve model core: four causal attention kinds behind one chunk-and-state contract."""

from .config import BOS_TOKEN, BYTE_VOCAB, ModelConfig
from .state import ModelState
from .transformer import SequenceTooLong, Transformer, build_model

__all__ = ["BOS_TOKEN", "BYTE_VOCAB", "ModelConfig", "ModelState", "SequenceTooLong", "Transformer", "build_model"]
