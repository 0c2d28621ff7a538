"""specserve: speculative decoding with variable-length verification and an exact output ledger."""

from specserve.engine.outputs import CompletionOutput, RequestOutput
from specserve.inputs import TextPrompt, TokensPrompt
from specserve.sampling_params import InvalidRequestError, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineStepError",
    "InvalidRequestError",
    "RequestOutput",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code (the engine's errors numpy); import lazily so `specserve --help` stays fast
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    if name == "EngineStepError":
        from specserve.engine.isolation import EngineStepError

        return EngineStepError
    raise AttributeError(name)
