"""specserve: speculative decoding with variable-length verification and an exact output ledger."""

from specserve.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "InvalidRequestError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import lazily so `specserve --help` stays fast
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    raise AttributeError(name)
