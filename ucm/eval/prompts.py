"""Token-level prompt building for chunked (RAG-style) prompts in a chat format.

Each chunk is tokenised on its own, so its tokens are the same wherever it appears in a prompt:
that is what lets its stored KV be found again by hash. The chunk marker is the chat template's
end-of-message token: the system message and every passage (one user message each) end with
it, as chat prompts naturally do, so online chat requests are chunked the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ucm.eval.datasets import QAExample

# SmolLM2 / ChatML: <|im_end|> closes every message.
DEFAULT_CHUNK_END_TOKEN = "<|im_end|>"
SYSTEM = "<|im_start|>system\nYou answer questions about the passages the user gives you. Answer with a few words only."
PASSAGE = "\n<|im_start|>user\n{passage}"
# A related passage indexed before another one as its context (related.py): worded differently
# from PASSAGE so that it is never stored under the passage's own chunk hash.
RELATED = "\n<|im_start|>user\nRelated: {passage}<|im_end|>"
QUESTION = "\n<|im_start|>user\nQuestion: {question}<|im_end|>\n<|im_start|>assistant\n{answer_prefix}"


@dataclass(frozen=True)
class ChunkedPrompt:
    token_ids: list[int]
    chunk_lengths: list[int]  # system + passages, each including its marker token


def chunk_end_token_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids(DEFAULT_CHUNK_END_TOKEN)


def build_prompt(tokenizer, example: QAExample, marker_id: int, order: list[int] | None = None) -> ChunkedPrompt:
    texts = [SYSTEM] + [PASSAGE.format(passage=example.passages[i]) for i in (order or range(len(example.passages)))]
    token_ids: list[int] = []
    lengths: list[int] = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False) + [marker_id]
        token_ids.extend(ids)
        lengths.append(len(ids))
    question = QUESTION.format(question=example.question, answer_prefix=example.answer_prefix)
    token_ids.extend(tokenizer.encode(question, add_special_tokens=False))
    return ChunkedPrompt(token_ids, lengths)


def question_tokens(tokenizer, example: QAExample) -> int:
    """Tokens of the prompt after its last passage: the question message and the answer prefix."""
    text = QUESTION.format(question=example.question, answer_prefix=example.answer_prefix)
    return len(tokenizer.encode(text, add_special_tokens=False))
