"""FlashSpec: exact speculative decoding with several drafters chosen online by a bandit."""
from flashspec_core.bandit import STRATEGIES, ArmState, Bandit
from flashspec_core.engine import MODES, PRESETS, Engine, EngineBusyError, GenerationResult, RoundEvent, TokenSpan
from flashspec_core.models import ModelUnavailableError
from flashspec_core.sampling import SamplingConfig

__all__ = ["ArmState", "Bandit", "Engine", "EngineBusyError", "GenerationResult", "MODES", "ModelUnavailableError", "PRESETS",
           "RoundEvent", "STRATEGIES", "SamplingConfig", "TokenSpan"]
