"""A draft model for speculative decoding (``plugin_type`` draft_model): a smaller model of the target's tokenizer
proposes each drafting row's next k tokens, greedily, all rows batched through its own packed runner and K/V
cache; the engine verifies them exactly as it verifies n-gram drafts, so the output is the plain run's whatever
the draft model says (docs/speculative.md "A draft model").

Its cache has as many blocks as the target's, and a sequence uses the same block ids in both, so it needs no
allocator: the target's reservation at admission (prompt + max_new_tokens) covers the draft positions too. What
a sequence's draft cache holds is its drafter's ``cache.fed``, the tokens written at positions 0.. in order; after a
verify step it keeps the prefix the sequence's real tokens still agree with and feeds the rest (``DraftCache``,
speculative.py)."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from backends.mindspore.families import family_of
from backends.mindspore.engine.speculative import Drafter
from backends.mindspore.runners.step import PrefillChunk
from backends.mindspore.modeldir.tokenizer import Tokenizer

if TYPE_CHECKING:
    from backends.mindspore.runners.base import ModelRunner
    from backends.mindspore.modeldir.spec import ModelSpec

KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].plugin_params draft_model_path"


class DraftModelError(ValueError):
    """The draft model cannot draft for this target (another tokenizer, not the AOT kernels); names the key."""


class Drafting(Protocol):
    """What the draft model reads of a sequence (``SeqState``)."""

    prompt_ids: list[int]
    generated: list[int]
    blocks: list[int]
    drafter: Drafter


def check_tokenizer(draft: Tokenizer, target: Tokenizer, path: Path) -> None:
    """DraftModelError naming the keys unless ``draft`` and ``target`` map the same ids to the same tokens."""
    if draft.vocab_size != target.vocab_size:
        raise DraftModelError(f"{KEY} {path}: the draft model's tokenizer has {draft.vocab_size} tokens and "
                              f"modelWeightPath's {target.vocab_size}; a draft model must share the tokenizer")
    differ = next((i for i in range(target.vocab_size) if draft.token_str(i) != target.token_str(i)), None)
    if differ is not None:
        raise DraftModelError(f"{KEY} {path}: token {differ} is {draft.token_str(differ)!r} in the draft model's "
                              f"tokenizer and {target.token_str(differ)!r} in modelWeightPath's; a draft model must "
                              "share the tokenizer")


def check_draft_spec(spec: ModelSpec, window: int) -> None:
    """DraftModelError naming the key unless ``spec`` is a text model whose positions reach the target's
    attention window (the draft model runs on the target's shapes)."""
    if family_of(spec.arch).capabilities.vision:
        raise DraftModelError(f"{KEY} {spec.model_dir}: a vision-language model cannot be a draft model")
    if spec.max_position_embeddings and spec.max_position_embeddings < window:
        raise DraftModelError(f"{KEY} {spec.model_dir}: the draft model's max_position_embeddings "
                              f"{spec.max_position_embeddings} is below the served sequence length {window} "
                              "(lower maxSeqLen, or draft with a model of longer positions)")


class DraftModel:
    """The draft network's runner (its own weights and cache) and the batched greedy proposal."""

    def __init__(self, spec: ModelSpec, runner: ModelRunner, vocab_size: int) -> None:
        self.spec, self.name = spec, spec.model_dir.name
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: a proposal is always one of its ids
        shapes = runner.shapes
        self._max_tokens, self._max_rows = shapes.prefill_sizes[-1], shapes.batch_buckets[-1]
        self._piece = shapes.prefill_chunk
        self.calls = 0  # forward calls of the draft network (for /info)

    def propose(self, wants: Mapping[Drafting, int]) -> dict[Drafting, list[int]]:
        """``wants[seq]`` greedy draft tokens for each sequence: first its tokens the draft cache lacks (in pieces
        of a prompt chunk), whose last logits give draft 1, then one token per row and call."""
        drafts: dict[Drafting, list[int]] = {seq: [] for seq in wants}
        pieces = {seq: self._pieces(seq) for seq in wants}
        for r in range(max((len(p) for p in pieces.values()), default=0)):
            rows = [(seq, p[r]) for seq, p in pieces.items() if r < len(p)]
            logits = self._forward([PrefillChunk(ids, start, seq.blocks) for seq, (start, ids) in rows])
            for (seq, _), row in zip(rows, logits):
                if r == len(pieces[seq]) - 1:
                    drafts[seq].append(self._greedy(row))
        for i in range(1, max(wants.values(), default=0)):
            rows = [seq for seq, n in wants.items() if n > i]
            chunks = []
            for seq in rows:
                token = drafts[seq][-1]
                chunks.append(PrefillChunk([token], len(seq.drafter.cache.fed), seq.blocks))
                seq.drafter.cache.fed.append(token)
            for seq, row in zip(rows, self._forward(chunks)):
                drafts[seq].append(self._greedy(row))
        return drafts

    def _pieces(self, seq: Drafting) -> list[tuple[int, list[int]]]:
        """(start position, ids) of the tokens ``seq``'s draft cache lacks, a prompt chunk at most each; they
        count as fed from here on."""
        cache = seq.drafter.cache
        tokens = cache.pending(seq.prompt_ids + seq.generated)
        start = len(cache.fed)
        cache.fed.extend(tokens)
        return [(start + at, tokens[at:at + self._piece]) for at in range(0, len(tokens), self._piece)]

    def _forward(self, chunks: list[PrefillChunk]) -> list[np.ndarray]:
        """The last-token logits of each chunk, in as few packed calls as the compiled sizes allow."""
        out: list[np.ndarray] = []
        at = 0
        while at < len(chunks):
            end, tokens = at, 0
            while end < len(chunks) and end - at < self._max_rows and tokens + len(chunks[end].ids) <= self._max_tokens:
                tokens += len(chunks[end].ids)
                end += 1
            logits, _ = self.runner.prefill(chunks[at:end])
            self.calls += 1
            out.extend(logits[:end - at])
            at = end
        return out

    def _greedy(self, logits: np.ndarray) -> int:
        return int(np.argmax(np.asarray(logits)[: self.vocab_size]))

    def warmup(self, progress: bool = False) -> None:
        self.runner.warmup(progress)

    def close(self) -> None:
        """Stop mapping its cache's pages (the engine is closing)."""
        self.runner.close()

    def release(self) -> None:
        """Give its network's memory back (the engine's thread has stopped)."""
        self.runner.release()

    def graph_parts(self) -> list[str]:
        """What shapes the draft network's graphs, for the graph cache's key (``graph_cache.graph_key``): they
        are compiled after the target's, into the same directory."""
        from backends.mindspore.planning.graph_cache import graph_key

        return ["draft", graph_key(self.runner.graph_parts, self.spec.model_dir, self.spec.yaml_path)]

    def info(self) -> dict:
        return {"draft_model": self.name, "draft_forward_calls": self.calls,
                "draft_compiled_graphs": len(self.runner.compiled)}
