"""One llama.cpp step: the works laid into the batch (padded for prompts, shaped for
decodes, butter/backends/step_layouts.py), evaluated, evaluated again where llama.cpp split a
step butter's projection was armed for, and their rows sampled."""

from __future__ import annotations

import ctypes
import time
from typing import Any

import attrs
import llama_cpp as ll
import numpy as np

from butter.backends.base import (
    BackendError,
    PromptImage,
    Scored,
    SeqWork,
    StepResult,
    image_token_ids,
)
from butter.backends.llama_cpp.drafter import DraftModel
from butter.backends.llama_cpp.loading import MIN_PROMPT_ROWS, LlamaModel
from butter.backends.llama_cpp.positions import PlacedImage, SequencePositions
from butter.backends.llama_cpp.sampling import Samplers
from butter.backends.llama_cpp.vision import Projector
from butter.backends.lmhead import Verdict
from butter.backends.logprobs import token_logprobs
from butter.backends.step_layouts import LayoutTimer, StepLayout, padded_outputs
from butter.chat.request import Logprobs

# (seq, batch row, output ordinal) of a row to sample
SampleRow = tuple[int, int, int]

# llama.cpp's CPU matmuls take one code path for batches of fewer than this many rows and
# another from there on (docs/design/numerics.md, "Numerics and determinism"): within the
# first, every row is computed as it would be alone.
EXACT_BATCH_ROWS = 8
# Its CPU flash attention computes a step of one query row another way (split over the
# cache's cells, from 512 of them on) than the rows of a bigger step (each row over all its
# cells), and the two round differently. Where exactness is asked for, a one-row step gets
# a scratch row beside it, so that a decode row is computed the same alone or not (and a
# draft's rows as the one-row steps they stand for); it costs a pass of the repacked
# kernels and the split's speed (docs/design/numerics.md, "Numerics and determinism").
ONE_ROW_SCRATCH = 1
# Its repacked kernels (Q4_0, Q4_K, IQ4_NL) multiply a batch's rows four at a time and the
# rest one by one, so only batches of up to this many rows compute each row as alone.
REPACKED_EXACT_ROWS = 3

# llama.cpp's CPU flash attention evaluates queries in tiles of this many rows
# (GGML_FA_TILE_Q), and skips a block of the cache only where the whole tile is masked from
# it. The step planner cuts the chunks of several prompts in one batch to whole tiles, so no
# tile holds two sequences' rows (Backend.prompt_tile). butter's prompt attention
# (prompt_attention.h), where it runs, takes tiles of a power of two rows up to 64, which
# these cuts keep to one sequence too (a tile's cost is that of every cell its rows see).
PROMPT_TILE_ROWS = 64
# A tile that holds other sessions' decode rows beside a prompt chunk cannot skip the cache
# blocks its chunk rows never see (other sessions' cells, and on sliding-window layers
# everything outside the window) and is computed against the whole cache, and the few extra
# rows leave partial tiles that cost as much as whole ones. A step with at least a tile of
# prompt rows therefore evaluates its decode rows first, on their own, then the prompt rows:
# one more pass over the weights, for a step that is 10-25% cheaper (measured in
# docs/design/prompt-chunks.md, "Decode rows beside a prompt chunk"). Smaller steps stay on the
# per-row kernel, where mixing costs nothing.
SEPARATE_PROMPT_ROWS = PROMPT_TILE_ROWS


@attrs.frozen
class DraftRows:
    """The rows of a decode with a draft (SeqWork.drafted): sampled in order while each
    sample equals the draft token after it."""

    seq: int
    start: int  # the work's first position
    rows: tuple[tuple[int, int], ...]  # (batch row, output ordinal), the sampled token's on
    draft: tuple[int, ...]
    tokens: tuple[int, ...]  # the work's tokens, the draft's included

    def kept_tokens(self, kept: int) -> tuple[int, ...]:
        """The tokens whose cells stay in the cache when `kept` rows were sampled: those up
        to the last kept row's (the last sample is the next step's input)."""
        return self.tokens[:len(self.tokens) - len(self.rows) + kept]


# A recurrent or hybrid model's state cannot be cut back to a position (its recurrent
# layers hold one state per sequence, the last token's), so the rows of a rejected draft
# cannot simply be forgotten. Such a model's drafting sequences are checkpointed before
# the step that verifies their drafts (the recurrent state alone, PARTIAL_ONLY: the
# attention KV can be cut where the recurrent state is back at or before the cut); where a
# draft is rejected, its sequence gets that state back, its cache is cut to the work's
# start, and the tokens it keeps are evaluated again (all such sequences of the step in
# one more evaluation, without logits): the state then is what evaluating the kept tokens
# alone leaves. On llama.cpp's CPU the gated delta net (fused) and the short convolution
# run token after token whatever the step's width, so the state and the cells are bit for
# bit those of decoding one token a step (tests/test_speculation.py), provided every row
# is computed as alone: a hybrid whose float matrices llama.cpp multiplies does not draft
# (Backend._draft_rows), nor does a purely recurrent model (Mamba: its state's bits
# change with the step's width). The saves, restores and replays all fall inside the
# step's measured time, so Speculation's cost model weighs them.


# A prompt's image positions are evaluated from the projector's embeddings of the image
# (vision.py), not from tokens, and llama.cpp takes no batch that mixes the two
# (llama-batch.cpp: "all entries in the batch must have the same content types"). A work
# whose tokens include image positions (SeqWork.images) is cut into runs, text and image
# alternately, each evaluated in an llama_decode of its own, in order, the last one's last
# row sampled; the other works of its step are evaluated as any step's, before it. Each run
# is padded to MIN_PROMPT_ROWS rows with the scratch sequence as a prompt chunk is, so that
# its rows are computed as in any other cut of the prompt: the same image in one work or
# split between two (a chunk boundary, or a cached prefix, inside it) leaves the same cells.
# The embeddings of the last few images are kept (Projector.embeddings), so a work that
# holds the rest of an image does not encode it again. An image whose embeddings see each
# other (PromptImage.causal false: Gemma 3's) comes whole in one work (step_plan.py) and is
# decoded with llama.cpp's causal mask off, as libmtmd's helper decodes it.


def image_runs(work: SeqWork) -> list[tuple[int, int, PromptImage | None]]:
    """The work's rows as runs of consecutive rows: (first, end) offsets into its tokens,
    and the image whose positions they are (None: tokens). One run of tokens where no image
    overlaps the work."""
    first, end = work.start, work.start + len(work.tokens)
    spans = sorted(((max(image.start, first), min(image.end, end), image)
                    for image in work.images if image.start < end and image.end > first),
                   key=lambda span: span[0])
    runs: list[tuple[int, int, PromptImage | None]] = []
    at = first
    for start, stop, image in spans:
        if start < at:
            raise BackendError(f"images overlap at position {start} of seq {work.seq}")
        if start > at:
            runs.append((at - first, start - first, None))
        runs.append((start - first, stop - first, image))
        at = stop
    if at < end:
        runs.append((at - first, end - first, None))
    return runs


def has_image_rows(work: SeqWork) -> bool:
    end = work.start + len(work.tokens)
    return any(image.start < end and image.end > work.start for image in work.images)


@attrs.frozen
class ScoreRow:
    """A prompt row whose logits score the prompt's next token."""

    seq: int
    row: int
    ordinal: int
    target: int
    top: int


class Stepper:
    """Evaluates the works of a step and samples them (on the backend's thread)."""

    def __init__(self, model: LlamaModel, samplers: Samplers, layouts: LayoutTimer, *,
                 separate_prompts: bool = True, pad_one_row: bool = False,
                 drafter: DraftModel | None = None, projector: Projector | None = None,
                 positions: SequencePositions | None = None) -> None:
        self._model = model
        self.projector = projector  # the vision projector, if one is loaded
        # Where images take M-RoPE positions: each sequence's cells' positions (None: a
        # cell's position is its index)
        self.positions = positions
        self._samplers = samplers
        self.layouts = layouts
        # Decode rows and a long prompt chunk in separate evaluations (SEPARATE_PROMPT_ROWS)
        self.separate_prompts = separate_prompts
        self.pad_one_row = pad_one_row  # a scratch row beside one-row steps (ONE_ROW_SCRATCH)
        self.drafter = drafter  # the draft model that fills SeqWork.guess, if any
        self.ours = False  # whether butter's projection gave the last decode's logits
        self.redone_steps = 0  # steps evaluated again because llama.cpp split them
        self.separated_steps = 0  # steps whose decode rows went first, on their own
        self._decode_seconds = 0.0  # llama_decode time of the current step
        # A recurrent or hybrid model: drafting sequences are checkpointed before their
        # drafts are verified, their kept tokens evaluated again after a rejection.
        self.checkpoints_drafts = model.info.is_recurrent
        self._checkpoints: dict[int, tuple[Any, int]] = {}  # seq -> (buffer, bytes)
        self.replayed_steps = 0  # evaluations of the tokens rejected drafts kept
        self.replayed_tokens = 0
        self._logits_gone = False  # a replay came after the last decode's sampling
        self.image_runs = 0  # llama_decodes of image embeddings

    def evaluate(self, works: list[SeqWork]) -> list[StepResult]:
        """Evaluate the works in the shape the layouts chooses; their sampled tokens."""
        if not works:
            return []
        if any(work.images for work in works):
            imaged = [has_image_rows(work) for work in works]
            if any(imaged):
                others = [work for work, has in zip(works, imaged, strict=True) if not has]
                results = self.evaluate(others)
                for work, has in zip(works, imaged, strict=True):
                    if has:
                        results += self._evaluate_runs(work)
                return results
        if any(work.guess for work in works):
            works = [self._guessed(work) for work in works]
        prompting = [work for work in works if work.prompt]
        decode_only = not prompting
        if (self.separate_prompts and not decode_only and len(prompting) < len(works)
                and sum(len(work.tokens) for work in prompting) >= SEPARATE_PROMPT_ROWS):
            self.separated_steps += 1
            decoded = self.evaluate([work for work in works if not work.prompt])
            return decoded + self.decode(prompting, outputs=0)
        if any(work.drafted for work in works):  # rows computed as alone: as they are
            return self.decode(works, outputs=0)
        outputs = sum(1 for work in works if work.sample)
        shape = self.layouts.choose(outputs, decode_only=decode_only)
        self._decode_seconds = 0.0
        if shape is StepLayout.SPLIT:
            sampled: list[StepResult] = [
                s for work in works for s in self.decode([work], outputs=0)]
        elif shape is StepLayout.LLAMA_HEAD:
            sampled = self.decode(works, outputs=0, ours=False)
        else:
            wanted = padded_outputs(outputs) if shape is StepLayout.PADDED else 0
            sampled = self.decode(works, outputs=wanted)
        if decode_only:  # the decodes only: sampling costs the same in every shape
            self.layouts.observe(outputs, shape, self._decode_seconds)
        return sampled

    def _guessed(self, work: SeqWork) -> SeqWork:
        """A work whose draft model guesses (SeqWork.guess), as a draft to verify."""
        if not work.guess:
            return work
        if self.drafter is None:
            raise BackendError("a step asked for guesses, and no draft model is loaded")
        guesses = self.drafter.guess(work.seq, [*work.history, *work.tokens], work.guess)
        return attrs.evolve(work, tokens=work.tokens + guesses, drafted=len(guesses),
                            guess=0, history=())

    def decode(self, works: list[SeqWork], *, outputs: int, ours: bool = True
               ) -> list[StepResult]:
        """One llama_decode of these works (logits on at least `outputs` rows), sampled
        (and scored, for works that ask). `ours`: butter's projection where it can;
        False: llama.cpp's."""
        model = self._model
        sample_rows, draft_rows, score_rows, n_outputs, padded = self._fill_batch(
            works, outputs=outputs)
        self._logits_gone = False
        if draft_rows and self.checkpoints_drafts:
            for draft in draft_rows:
                self._checkpoint(draft.seq)
        head = model.lm_head
        armed = ours and head is not None and n_outputs <= head.rows
        status, verdict = self._evaluate(armed, n_outputs)
        if status == 0 and verdict is Verdict.NEITHER:
            # llama.cpp split the step into micro-batches: butter's logits may be out of
            # order and llama.cpp's incomplete. Rare (a fragmented sliding-window cache);
            # evaluate the step again with llama.cpp's own projection.
            self._rewind_batch(works)
            self.redone_steps += 1
            status, verdict = self._evaluate(False, n_outputs)
        self.ours = verdict is Verdict.OURS
        if padded:
            ll.llama_memory_seq_rm(model.mem, model.pad_seq, -1, -1)
        if status != 0:
            raise BackendError(f"llama_decode failed with status {status}")
        sampled: list[StepResult] = list(self._samplers.sample_rows(sample_rows, ours=self.ours))
        rejected: list[SeqWork] = []
        for draft in draft_rows:
            verified = self._samplers.verify(draft.seq, draft.rows, draft.draft,
                                             ours=self.ours)
            sampled += verified
            if len(verified) < len(draft.rows):
                rejected += self._take_back(draft, len(verified))
        sampled += self._scored(score_rows)  # (from this decode's logits: before a replay)
        if rejected:
            self._replay(rejected)
        return sampled

    def _evaluate_runs(self, work: SeqWork) -> list[StepResult]:
        """A work whose tokens include image positions, run after run (image_runs)."""
        if work.drafted or work.guess:
            raise BackendError("a work with image positions cannot verify drafts")
        if work.prompt_top_logprobs is not None:
            raise BackendError("prompt tokens are not scored across an image")
        runs = image_runs(work)
        sampled: list[StepResult] = []
        for index, (first, end, image) in enumerate(runs):
            sample = work.sample and index == len(runs) - 1
            start = work.start + first
            tokens = work.tokens[first:end]
            if image is None:
                if min(tokens) < 0:
                    raise BackendError(f"seq {work.seq} has an image id at position "
                                       f"{start + tokens.index(min(tokens))} outside its images")
                part = attrs.evolve(work, tokens=tokens, start=start, sample=sample, images=())
                sampled += self.decode([part], outputs=0)
            else:
                sampled += self._decode_image(work.seq, image, start, tokens, sample=sample)
        return sampled

    def _decode_image(self, seq: int, image: PromptImage, start: int, tokens: tuple[int, ...],
                      *, sample: bool) -> list[StepResult]:
        """One llama_decode of `image`'s embedding rows for positions `start`.. (as many as
        `tokens`, its ids there), padded as a prompt chunk; the last row sampled if asked."""
        projector, model = self.projector, self._model
        if projector is None:
            raise BackendError("a prompt holds an image, and no projector is loaded")
        offset = start - image.start
        if tokens != image_token_ids(image.key, image.n_tokens)[offset:offset + len(tokens)]:
            raise BackendError(f"seq {seq}'s ids at positions {start}.. are not its image's")
        if not image.causal and len(tokens) != image.n_tokens:
            raise BackendError(f"an image whose embeddings see each other is evaluated "
                               f"whole, not {len(tokens)} of its {image.n_tokens} positions")
        embd = projector.embeddings(image)
        if len(embd) != image.n_tokens:
            raise BackendError(f"the projector made {len(embd)} embeddings of an image that "
                               f"takes {image.n_tokens} positions")
        rows = np.ascontiguousarray(embd[offset:offset + len(tokens)], dtype=np.float32)
        n_rows = len(rows)
        padding = max(0, MIN_PROMPT_ROWS - n_rows)
        sections = None
        if image.grid is not None:
            if self.positions is None:
                raise BackendError("an image with M-RoPE positions, and no positions kept")
            p0 = self.positions.position(seq, image.start)
            self.positions.place(seq, PlacedImage(image.start, image.n_tokens,
                                                  image.grid.n_pos))
            sections = image.grid.sections(p0, offset, n_rows)
        batch = projector.batch
        address = ctypes.cast(batch.embd, ctypes.c_void_p).value
        assert address is not None
        ctypes.memmove(address, rows.ctypes.data, rows.nbytes)
        if padding:  # the scratch sequence's rows: zeros
            ctypes.memset(address + rows.nbytes, 0, padding * rows.shape[1] * rows.itemsize)
        for row in range(n_rows + padding):
            ours = row < n_rows
            if sections is None:
                batch.pos[row] = start + row if ours else row - n_rows
            else:  # (section-major: llama_decode reads section s of row r at s x rows + r)
                for section, values in enumerate(sections):
                    batch.pos[section * (n_rows + padding) + row] = (
                        values[row] if ours else row - n_rows)
            batch.n_seq_id[row] = 1
            batch.seq_id[row][0] = seq if ours else model.pad_seq
            batch.logits[row] = sample and row == n_rows - 1
        batch.n_tokens = n_rows + padding
        if model.lm_head is not None:
            model.lm_head.arm(False)  # (llama.cpp's logits: one row at most, sampled now)
        started = time.perf_counter()
        if not image.causal:  # (the scratch rows are another sequence's: they see none)
            ll.llama_set_causal_attn(model.ctx, False)
        try:
            status = int(ll.llama_decode(model.ctx, batch))
            ll.llama_synchronize(model.ctx)
        finally:
            if not image.causal:
                ll.llama_set_causal_attn(model.ctx, True)
        self._decode_seconds += time.perf_counter() - started
        if padding:
            ll.llama_memory_seq_rm(model.mem, model.pad_seq, -1, -1)
        if status != 0:
            raise BackendError(f"llama_decode of an image's embeddings failed with status "
                               f"{status}")
        self.image_runs += 1
        self.ours, self._logits_gone = False, False
        if not sample:
            return []
        return list(self._samplers.sample_rows([(seq, n_rows - 1, 0)], ours=False))

    def _take_back(self, draft: DraftRows, kept: int) -> list[SeqWork]:
        """A draft's rows that were not kept leave the cache (each sample's token is the
        next row's input only where it equals the draft). A recurrent or hybrid model's
        sequence gets its checkpoint back instead, is cut to the work's start, and the
        tokens it keeps are returned, to be evaluated again."""
        model = self._model
        kept_tokens = draft.kept_tokens(kept)
        if not self.checkpoints_drafts:
            ll.llama_memory_seq_rm(model.mem, draft.seq,
                                   self.position(draft.seq, draft.start + len(kept_tokens)), -1)
            return []
        buffer, size = self._checkpoints[draft.seq]
        # The recurrent state first: with it back before the cut, the cut is allowed.
        if not (size and model.load_recurrent_state(draft.seq, buffer, size)
                and ll.llama_memory_seq_rm(model.mem, draft.seq,
                                           self.position(draft.seq, draft.start), -1)):
            raise BackendError(f"seq {draft.seq} could not be taken back to position "
                               f"{draft.start} after its draft was rejected")
        return [SeqWork(draft.seq, kept_tokens, draft.start, sample=False)]

    def _checkpoint(self, seq: int) -> None:
        """Save `seq`'s recurrent state (into its buffer of the last time, where it fits)."""
        buffer, _ = self._checkpoints.get(seq, (None, 0))
        self._checkpoints[seq] = self._model.save_recurrent_state(seq, buffer)

    def _replay(self, works: list[SeqWork]) -> None:
        """Evaluate the tokens rejected drafts kept, without logits (their samples are
        taken), shaped as any step of their rows (a scratch row beside a lone one, where
        exactness asks for it)."""
        _, _, _, _, padded = self._fill_batch(works)
        status, _ = self._evaluate(False, 0)
        if padded:
            ll.llama_memory_seq_rm(self._model.mem, self._model.pad_seq, -1, -1)
        self._logits_gone = True  # (llama.cpp's output buffer now holds no rows)
        if status != 0:
            raise BackendError(f"llama_decode of kept draft tokens failed with status {status}")
        self.replayed_steps += 1
        self.replayed_tokens += sum(len(work.tokens) for work in works)

    def _scored(self, rows: list[ScoreRow]) -> list[StepResult]:
        """Each scoring work's logprobs, from its rows' logits."""
        model, head = self._model, self._model.lm_head
        by_seq: dict[int, list[Logprobs]] = {}
        for r in rows:
            logits = (head.row(r.ordinal) if self.ours and head is not None
                      else model.llama_logits(r.row))
            by_seq.setdefault(r.seq, []).append(
                token_logprobs(logits, r.target, r.top, model.piece))
        return [Scored(seq, tuple(logprobs)) for seq, logprobs in by_seq.items()]

    def _evaluate(self, armed: bool, n_outputs: int) -> tuple[int, Verdict]:
        """llama_decode of the filled batch, butter's projection armed or not."""
        model = self._model
        head = model.lm_head
        if head is not None:
            head.arm(armed)
        started = time.perf_counter()
        status = int(ll.llama_decode(model.ctx, model.batch))
        ll.llama_synchronize(model.ctx)  # GPU builds return before the work is done
        self._decode_seconds += time.perf_counter() - started
        if head is None:
            return status, Verdict.LLAMA
        verdict = head.verdict(n_outputs)
        head.arm(False)
        return status, verdict

    def _rewind_batch(self, works: list[SeqWork]) -> None:
        """Forget what the last llama_decode of these works wrote into the cache."""
        model = self._model
        for work in works:
            ll.llama_memory_seq_rm(model.mem, work.seq, self.position(work.seq, work.start), -1)
        ll.llama_memory_seq_rm(model.mem, model.pad_seq, -1, -1)

    def position(self, seq: int, index: int) -> int:
        """llama.cpp's position of `seq`'s cell at `index` (SequencePositions)."""
        return index if self.positions is None else self.positions.position(seq, index)

    def _fill_batch(
        self, works: list[SeqWork], *, outputs: int = 0,
    ) -> tuple[list[SampleRow], list[DraftRows], list[ScoreRow], int, bool]:
        """Write the works into the batch.

        Returns the rows to sample, the drafts' rows to verify, the rows that score a prompt
        token, the number of rows with logits, and whether scratch rows were added.

        `outputs`: request logits on at least this many rows (see butter.backends.step_layouts),
        first on rows that need none, then on scratch rows."""
        model = self._model
        rows = sum(len(work.tokens) for work in works)
        if rows > model.n_batch:
            raise BackendError(f"a step of {rows} tokens exceeds the batch size {model.n_batch}")
        prompt_padding = 0
        if any(work.prompt for work in works) and rows < MIN_PROMPT_ROWS:
            prompt_padding = MIN_PROMPT_ROWS - rows
        if self.pad_one_row and rows == 1:
            prompt_padding = ONE_ROW_SCRATCH
        sampled = sum(1 + work.drafted for work in works if work.sample)
        spare_outputs = max(0, outputs - sampled)
        padding = max(prompt_padding, spare_outputs - (rows - sampled))
        if rows + padding > model.n_batch:  # no room to shape: evaluate as it is
            padding, spare_outputs = prompt_padding, 0
        if padding:
            works = [*works, SeqWork(model.pad_seq, (0,) * padding, 0, sample=False)]
        batch = model.batch
        token, pos, n_seq_id = batch.token, batch.pos, batch.n_seq_id
        seq_id, logits = batch.seq_id, batch.logits
        row = n_outputs = 0
        sample_rows: list[SampleRow] = []
        draft_rows: list[DraftRows] = []
        score_rows: list[ScoreRow] = []
        for work in works:
            last = len(work.tokens) - 1
            first_sampled = last - work.drafted
            verifying: list[tuple[int, int]] = []
            # (text: its positions follow each other from its first's)
            start = self.position(work.seq, work.start)
            for offset, tok in enumerate(work.tokens):
                token[row] = tok
                pos[row] = start + offset
                n_seq_id[row] = 1
                seq_id[row][0] = work.seq
                wants = work.sample and offset >= first_sampled
                target = None
                if work.prompt_top_logprobs is not None:  # (a prompt scored: rare, never a decode)
                    target = work.tokens[offset + 1] if offset < last else work.next_token
                scores = target is not None
                output = wants or scores or spare_outputs > 0
                logits[row] = output
                if wants and work.drafted:
                    verifying.append((row, n_outputs))
                elif wants:
                    sample_rows.append((work.seq, row, n_outputs))
                if scores:
                    assert work.prompt_top_logprobs is not None and target is not None
                    score_rows.append(ScoreRow(work.seq, row, n_outputs, target,
                                               work.prompt_top_logprobs))
                if not (wants or scores) and spare_outputs > 0:
                    spare_outputs -= 1
                n_outputs += output
                row += 1
            if verifying:
                draft_rows.append(DraftRows(work.seq, work.start, tuple(verifying),
                                            work.tokens[first_sampled + 1:], work.tokens))
        batch.n_tokens = row
        return sample_rows, draft_rows, score_rows, n_outputs, padding > 0

    def step_logits(self, row: int) -> Any:
        """A copy of the logits batch row `row` of the last decode was sampled from (not
        after a recurrent model's rejected draft: the replay of its kept tokens has
        overwritten them)."""
        model = self._model
        if self._logits_gone:
            raise BackendError("the last step's logits are gone: a rejected draft's kept "
                               "tokens were evaluated again after it")
        if self.ours and model.lm_head is not None:
            ordinal = sum(bool(model.batch.logits[earlier]) for earlier in range(row))
            return model.lm_head.row(ordinal).copy()
        return model.llama_logits(row).copy()
