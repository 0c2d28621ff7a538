"""specserve: speculative decoding with variable-length verification and an exact output ledger."""

from specserve.engine.isolation import EngineStepError
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
    # LLM pulls in torch and the model code; import lazily so `specserve --help` stays fast
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    raise AttributeError(name)
