"""Request bodies of the pooling routes: OpenAI's `/v1/embeddings`, the Cohere/Jina rerank shape
vLLM serves (`/v1/rerank`, `/v2/rerank`) and vLLM's `/v1/score`. Strict on known fields, tolerant
of unknown ones (`tolerant`), as the generation routes are."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from dgpp.engine.sampling.sampling_params import PRIORITY_RANGE
from dgpp.engine.server.openai.tolerant import TolerantModel

# Inputs per request: each is a request of the engine's own (OpenAI allows 2,048).
MAX_INPUTS = 2048

Priority = StrictInt | None
_PRIORITY = Field(default=None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])


class EmbeddingRequest(TolerantModel):
    model: StrictStr | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    user: StrictStr | None = None
    # The prompt a sentence-transformers checkpoint names for this kind of text (its
    # config_sentence_transformers.json `prompts`: Qwen3-Embedding's "query" instruction), put
    # before each input; as NVIDIA's and Cohere's embedding APIs take it.
    input_type: StrictStr | None = Field(default=None, max_length=64)
    priority: Priority = _PRIORITY


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: StrictStr


class RerankRequest(TolerantModel):
    model: StrictStr | None = None
    query: StrictStr
    documents: list[StrictStr | RerankDocument] = Field(max_length=MAX_INPUTS)
    top_n: StrictInt | None = Field(default=None, ge=1)
    return_documents: StrictBool = True
    # The task a decoder reranker judges documents for (Qwen3-Reranker's <Instruct>)
    instruction: StrictStr | None = Field(default=None, max_length=4096)
    priority: Priority = _PRIORITY


class ScoreRequest(TolerantModel):
    model: StrictStr | None = None
    # One text against each of the others, or pairs of two lists of the same length
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    instruction: StrictStr | None = Field(default=None, max_length=4096)
    priority: Priority = _PRIORITY
