"""A trajectory: one growing list of token ids, only ever appended to.

Model tokens carry loss mask 1, the sampler's log-prob and the weights version that sampled them;
prompt and tool-response tokens carry mask 0, log-prob 0 and version -1 (nothing sampled them).
Text is kept per turn for reading, never re-tokenized for training.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class ToolRecord:
    code: str | None
    stdin: str
    status: str              # sandbox status, or "parse_error"
    output: str              # what the call answered (tool_output_text), before the format's truncation
    latency_s: float
    retries: int = 0         # times it was run again after the sandbox failed to serve it (agent_loop)
    shown: str | None = None  # what the model read inside its <tool_response> block (output truncated);
                              # None in journals written before it was kept


@dataclasses.dataclass
class Turn:
    text: str                # the assistant's text this turn
    num_tokens: int
    finish_reason: str       # engine finish reason: stop | eos | length
    version_start: int
    version_end: int
    tools: list[ToolRecord] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Trajectory:
    prompt_len: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int] = dataclasses.field(default_factory=list)  # per token: weights that sampled it, -1 if none
    kv_versions: list[int] = dataclasses.field(default_factory=list)  # per token: oldest weights in the KV it read, -1 if none
    turns: list[Turn] = dataclasses.field(default_factory=list)
    finish_reason: str = ""   # eos | length | max_turns
    response_text: str = ""   # decoded text after the prompt (model and tool tokens), for reading
    # The model's own words: each run of its tokens decoded without special tokens (EOS, pad, the
    # chat template's turn markers), runs joined by newlines. What the grader reads (model_text).
    graded_text: str = ""
    generation_s: float = 0.0
    tool_s: float = 0.0
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # problem id, sample index, ...

    def append(self, ids, mask: int, logprobs=None, versions=None, kv_versions=None):
        ids = list(ids)
        self.token_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.versions += list(versions) if versions is not None else [-1] * len(ids)
        self.kv_versions += list(kv_versions) if kv_versions is not None else (
            list(versions) if versions is not None else [-1] * len(ids))

    @property
    def num_response_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def tool_statuses(self) -> list[str]:
        return [t.status for turn in self.turns for t in turn.tools]

    @property
    def min_version(self) -> int:
        """The oldest weights version that sampled a token of it."""
        return min((v for v in self.versions if v >= 0), default=min((t.version_start for t in self.turns), default=0))

    @property
    def assistant_text(self) -> str:
        return "".join(t.text for t in self.turns)

    def model_spans(self) -> list[tuple[int, int]]:
        """[start, end) of each run of model tokens (loss mask 1), in order."""
        spans, start = [], None
        for i, m in enumerate(self.loss_mask + [0]):
            if m == 1 and start is None:
                start = i
            elif m != 1 and start is not None:
                spans.append((start, i))
                start = None
        return spans


def model_text(tokenizer, traj: Trajectory) -> str:
    """The text the model wrote, as the grader reads it: each run of its own tokens decoded with
    special tokens skipped (verl's reward decodes so), runs joined by newlines. The EOS that ends
    the last turn, a pad, or a chat-template marker never reaches an answer ("Answer: 1/2<|im_end|>"
    would not parse); tool outputs, which the model did not write, are not graded either."""
    return "\n".join(tokenizer.decode(traj.token_ids[a:b], skip_special_tokens=True) for a, b in traj.model_spans())
