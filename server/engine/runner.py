"""The device half of continuous batching: slot tensors and the model, on the engine's thread.

The runner owns a state of `max_batch` rows, allocated once, and per-row
slot tensors beside it (next-token logits, position, known tokens, drawn
tokens and their log-probabilities, sampling parameters). It prefills
rows, samples and decodes the live rows [0, n), carries out a pass's
`StepUpdate` (row copies, sample reads, compaction moves), and scores
prompts. Only the engine's worker thread calls it.

A pass's last tokens are fed (`feed`) when the next pass begins, after the
pass's events went out, so clients do not wait for that forward; `apply`
keeps them, moved with their rows, until then (rows admitted meanwhile sit
past them).

A non-streamed request's tokens are written into the (rows, max_len + 1)
`generated` buffer by position as they are drawn, so a step builds no
per-token objects for it; `read_sample` takes a finished row out in one go.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from model.decode.eager_and_cuda_graphs import EagerDecoder
from model.decode.choice import make_decoder
from model.decode.sampling import (
    BatchSampling,
    SamplingParams,
    force_tokens,
    penalize,
    repetition_penalized,
    sampling_logprobs,
    suppressed_until,
    token_logprobs,
    top_logprobs,
)
from model.state import ModelState
from model.transformer import Transformer, with_bos

from model.decode.particles import RowCopy
from server.engine.prefix_cache import LOGIT_BYTES, PrefixCache, restore_snapshot, take_snapshot
from server.engine.prefix_plan import PrefillPlan, SnapshotPolicy, plan_prefill, runs_of_equal_keys
from server.engine.scheduler import Placement
from server.engine.step import AppliedStep, RunnerOutput, SampleRead, SampleSpan, SchedulerOutput, StepNeeds, StepUpdate
from server.engine.types import GenerationRequest, PromptScores, TopLogprobs

if TYPE_CHECKING:
    from model.decode.compiled.background import CompileGate


MAX_TOP_LOGPROBS = 5  # alternatives kept per position (OpenAI allows up to 5)


@dataclass
class Slots:
    """Preallocated per-row tensors, (max_batch, ...) each, beside the model state."""

    logits: torch.Tensor  # (N, V) next-token logits per row
    position: torch.Tensor  # (N,) position being drawn
    forced: torch.Tensor  # (N, max_len + 1) known token per position, -1 if free
    generated: torch.Tensor  # (N, max_len + 1) token drawn at each position
    logprobs: torch.Tensor  # (N, max_len + 1) its log-probability, written while a row asks for them
    top_ids: torch.Tensor  # (N, max_len + 1, MAX_TOP_LOGPROBS) most likely tokens, while a row asks
    top_values: torch.Tensor  # (N, max_len + 1, MAX_TOP_LOGPROBS) their log-probabilities
    counts: torch.Tensor  # (N, V) tokens generated so far, counted while a row has penalties
    bias: torch.Tensor  # (N, V) logit bias
    frequency: torch.Tensor  # (N,) frequency penalty
    presence: torch.Tensor  # (N,) presence penalty
    seen: (
        torch.Tensor
    )  # (N, V) bool: tokens of the prompt or generated so far, kept while a row has a repetition penalty
    repetition: torch.Tensor  # (N,) repetition penalty (1: off)
    ends: torch.Tensor  # (N, V) bool: the tokens that end a row's sample, held back while it has min_tokens to go
    until: torch.Tensor  # (N,) the first position at which `ends` may be drawn (prompt length + min_tokens)
    sampling: BatchSampling  # (N,) each
    state: ModelState

    @classmethod
    def allocate(cls, model: Transformer, rows: int) -> "Slots":
        cfg, device = model.config, model.device

        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        # Positions run to max_len inclusive: a model that reads no start token before its prompt draws its last
        # token at position max_len (it never reads that one).
        positions = cfg.max_len + 1
        top = (rows, positions, MAX_TOP_LOGPROBS)
        sampling = BatchSampling(
            zeros(rows) + 1,
            zeros(rows, dtype=torch.long),
            zeros(rows) + 1,
            zeros(rows, dtype=torch.long),
            None,
            zeros(rows),
        )
        return cls(
            logits=zeros(rows, cfg.vocab_out),
            position=zeros(rows, dtype=torch.long),
            forced=zeros(rows, positions, dtype=torch.long) - 1,
            generated=zeros(rows, positions, dtype=torch.long),
            logprobs=zeros(rows, positions),
            top_ids=zeros(*top, dtype=torch.long),
            top_values=zeros(*top),
            counts=zeros(rows, cfg.vocab_out),
            bias=zeros(rows, cfg.vocab_out),
            frequency=zeros(rows),
            presence=zeros(rows),
            seen=zeros(rows, cfg.vocab_out, dtype=torch.bool),
            repetition=zeros(rows) + 1,
            ends=zeros(rows, cfg.vocab_out, dtype=torch.bool),
            until=zeros(rows, dtype=torch.long),
            sampling=sampling,
            state=model.new_state(rows),
        )

    def row_tensors(self) -> list[torch.Tensor]:
        s = self.sampling
        return [
            self.logits,
            self.position,
            self.forced,
            self.generated,
            self.logprobs,
            self.top_ids,
            self.top_values,
            self.counts,
            self.bias,
            self.frequency,
            self.presence,
            self.seen,
            self.repetition,
            self.ends,
            self.until,
            s.temperature,
            s.top_k,
            s.top_p,
            s.seed,
            *([s.min_p] if s.min_p is not None else []),
        ]

    def copy_rows(self, src: list[int], dst: list[int]) -> None:
        """Many copies in one indexed write per tensor; no row may be both a source and a destination."""
        s = torch.tensor(src, device=self.position.device)
        d = torch.tensor(dst, device=self.position.device)
        for t in self.row_tensors():
            t[d] = t[s]
        self.state.copy_rows(s, d)

    def batch_sampling(self, rows: int | list[int], filters: bool | None = None) -> BatchSampling:
        """Rows [0, n), or the rows listed; filters: whether any of them uses top-k, top-p or min-p, if known."""
        s, pick = self.sampling, (slice(0, rows) if isinstance(rows, int) else rows)
        min_p = s.min_p[pick] if s.min_p is not None else None
        return BatchSampling(s.temperature[pick], s.top_k[pick], s.top_p[pick], s.seed[pick], filters, min_p)

    def penalized(self, n: int) -> torch.Tensor:
        """Rows [0, n)'s logits after penalties, bias and min_tokens: what they draw from."""
        return self.adjusted(slice(0, n))

    def adjusted(self, rows: slice | list[int]) -> torch.Tensor:
        """The rows' logits after the repetition penalty (on the model's own logits, as Hugging Face applies it),
        OpenAI's penalties and bias, then min_tokens' hold on the tokens that end a sample: (R, V)."""
        logits = repetition_penalized(self.logits[rows], self.seen[rows], self.repetition[rows])
        logits = penalize(logits, self.counts[rows], self.frequency[rows], self.presence[rows], self.bias[rows])
        return suppressed_until(logits, self.ends[rows], self.position[rows], self.until[rows])

    def fill_adjustments(self, row: int, prompt: list[int], params: SamplingParams, eos: int | None) -> None:
        """A new sequence's penalties, bias and min_tokens hold (its earlier row's are stale)."""
        self.frequency[row], self.presence[row] = params.frequency_penalty, params.presence_penalty
        self.repetition[row] = params.repetition_penalty
        self.counts[row] = 0
        self.bias[row] = 0
        if params.logit_bias:
            ids, values = zip(*params.logit_bias.items())
            self.bias[row, list(ids)] = torch.tensor(values, device=self.bias.device)
        # A row's `seen` and `ends` count only under a penalty other than 1 and before `until`: a plain request's
        # row leaves them as they are.
        self.until[row] = len(prompt) + params.min_tokens
        if params.repetition_penalty != 1:
            self.seen[row] = False
            self.seen[row, prompt] = True
        if params.min_tokens:
            self.ends[row] = False
            ending = [*params.stop_token_ids, *([eos] if eos is not None and not params.ignore_eos else [])]
            self.ends[row, ending] = True


@dataclass
class Drawn:
    """One step's tokens for rows [0, n), with what the rows asked to know about them."""

    tokens: torch.Tensor  # (n,)
    logprobs: torch.Tensor | None = None  # (n,) log-probability of each token
    top_ids: torch.Tensor | None = None  # (n, MAX_TOP_LOGPROBS)
    top_values: torch.Tensor | None = None  # (n, MAX_TOP_LOGPROBS)


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        rows: int,
        cuda_graphs: bool,
        compile_decode: bool = False,
        compile_gate: CompileGate | None = None,
        prefix_cache_bytes: int = 0,
        prefix_cache_every: int = 0,
    ):
        """prefix_cache_bytes: the budget of the prefix cache of decode states (0, or a kind whose state cannot be
        snapshot exactly: no cache). prefix_cache_every: tokens read before the first of the periodic snapshots a
        long prompt's prefill stores, for a constant-size state (0: none; server/engine/prefix_plan.py)."""
        self.model = model.eval()
        self.rows = rows
        self.cuda_graphs = cuda_graphs
        self.compile_decode = compile_decode
        self.compile_gate = compile_gate  # shared by a server's engines: their background compiles take turns
        self._slots: Slots | None = None
        self.decoder: EagerDecoder | None = None  # None until allocated
        self._bos: tuple[ModelState, torch.Tensor] | None = None  # see _prefill_bos
        self._unfed: torch.Tensor | None = None  # (live,) the last pass's tokens, until its closing forward
        self.prefix_cache = (
            PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 and caches_prefixes(model) else None
        )
        self.prefix_policy = snapshot_policy(model, prefix_cache_every, prefix_cache_bytes)
        self.cached: list[int] = []  # the last prefill's prompt tokens per request that the prefix cache gave

    def allocate(self) -> None:
        """Slots, the state after BOS, and the decoder (may capture CUDA graphs, or start compiling
        in the background): once, at start."""
        self._slots = Slots.allocate(self.model, self.rows)
        self._bos = self._prefill_bos()
        self.decoder = make_decoder(self.model, self.slots.state, self.cuda_graphs, compiled=self.compile_decode)
        self.decoder.compile(background=True, gate=self.compile_gate)

    @property
    def slots(self) -> Slots:
        """The slot tensors, once allocated."""
        if self._slots is None:
            raise RuntimeError("the runner's slots are not allocated yet: allocate() first")
        return self._slots

    @property
    def stepper(self) -> EagerDecoder:
        """The decoder that runs the steps, once allocated."""
        if self.decoder is None:
            raise RuntimeError("the runner's decoder is not made yet: allocate() first")
        return self.decoder

    @property
    def _after_bos(self) -> tuple[ModelState, torch.Tensor]:
        """The state after BOS alone and its next-token logits, once allocated (see _prefill_bos)."""
        if self._bos is None:
            raise RuntimeError("the runner's state after BOS is not computed yet: allocate() first")
        return self._bos

    def adopt_compiled(self) -> None:
        """Between two steps: take in the graphs a background compile made."""
        self.stepper.adopt_compiled()

    # -- new sequences --------------------------------------------------------
    def prefill(self, requests: list[GenerationRequest], first: int) -> list[float]:
        """Prompts of equal length into rows [first, first + len(requests)): each takes the longest prefix of what
        it reads from the prefix cache and runs only the rest, one by one; the others run in one forward per run
        of neighbouring rows that store states at the same positions (server/engine/prefix_plan.py). Returns each
        prompt's log-likelihood under its sampling distribution (0.0 where not weighed); `cached` then holds each
        request's prompt tokens the cache gave."""
        plans = [self._plan(r, len(requests)) for r in requests]
        likelihoods = [0.0] * len(requests)
        self.cached = [0] * len(requests)
        for start, stop in runs_of_equal_keys([None if p.hit is not None else p.stops for p in plans]):
            likelihoods[start:stop] = self._prefill_run(requests[start:stop], first + start, plans[start].stops)
        for i, plan in enumerate(plans):
            if plan.hit is not None:
                self.cached[i], likelihoods[i] = self._prefill_hit(requests[i], first + i, plan)
        for i, request in enumerate(requests):
            self._fill_row(first + i, request)
            self._remember(request, first + i, likelihoods[i])
        return likelihoods

    def _prefill_run(self, requests: list[GenerationRequest], first: int, stops: tuple[int, ...]) -> list[float]:
        """One forward over prompts of equal length (one per piece between `stops`), into rows
        [first, first + len(requests))."""
        rows = slice(first, first + len(requests))
        logits = self._run_prompts(requests, first, stops)  # (count, lead + P, V)
        self.slots.logits[rows] = logits[:, -1].float()
        return [
            prompt_log_likelihood(logits[i, :-1], r) if r.particles is not None and r.prompt else 0.0
            for i, r in enumerate(requests)
        ]

    def _read_tokens(self, request: GenerationRequest) -> list[int]:
        """What the model reads for a prompt: its lead, then the prompt."""
        return [*self.model.config.prompt_lead(len(request.prompt)), *request.prompt]

    def _plan(self, request: GenerationRequest, sharing: int) -> PrefillPlan:
        """The longest cached prefix of what `request` reads, and where its prefill stores states (the cache's room
        split between the `sharing` prompts of the prefill); nothing for an empty prompt (its state is computed
        once at start). A weighed request (particles) takes only a prefix whose likelihood under its sampling
        distribution is known (it needs its whole prompt's), and stores no state mid-prefill."""
        if self.prefix_cache is None or not request.prompt:
            return PrefillPlan()
        tokens = self._read_tokens(request)
        if request.particles is None:
            found = self.prefix_cache.find(tokens, truncate=self.prefix_policy.truncates)
            return plan_prefill(found, len(tokens), self.prefix_policy, sharing)
        key = _likelihood_key(request)
        return PrefillPlan(self.prefix_cache.lookup(tokens, lambda snapshot: key in snapshot.likelihoods))

    def _prefill_hit(self, request: GenerationRequest, row: int, plan: PrefillPlan) -> tuple[int, float]:
        """Restore the cached state into `row` and run the tokens after it -> the prompt tokens the cache gave,
        and the prompt's log-likelihood (0.0 unless weighed; a weighed request's hit is never partial, so its
        snapshot's logits are those after its length)."""
        assert plan.hit is not None  # the caller checked
        tokens, state, hit = self._read_tokens(request), self.slots.state, plan.hit
        state.reset_rows([row])
        restore_snapshot(state, row, hit.snapshot, hit.length)
        predicting = hit.snapshot.logits[None]  # (1, V): the logits that predict the first token after the prefix
        if hit.length < len(tokens):
            logits = self._read_in_pieces([tokens], row, hit.length, plan.stops)  # (1, T - hit, V)
            predicting = torch.cat([predicting, logits[0, :-1].float()])  # (T - hit, V)
            self.slots.logits[row] = logits[0, -1].float()
        else:  # all of it: the snapshot's logits are the next token's
            self.slots.logits[row] = hit.snapshot.logits
        likelihood = 0.0
        if request.particles is not None:
            before = hit.snapshot.likelihoods[_likelihood_key(request)]
            rest_likelihood = prompt_log_likelihood(predicting, request) if hit.length < len(tokens) else 0.0
            likelihood = before + rest_likelihood
        return max(0, hit.length - (len(tokens) - len(request.prompt))), likelihood

    def _read_in_pieces(self, tokens: list[list[int]], first: int, start: int, stops: tuple[int, ...]) -> torch.Tensor:
        """Rows [first, first + len(tokens)), whose states hold their first `start` tokens, read the rest of
        `tokens` (each as long), one forward per piece between `stops`; the state after each stop goes to the
        prefix cache -> (count, T - start, V) logits."""
        rows, total = self.slots.state.slice(first, first + len(tokens)), len(tokens[0])
        pieces: list[torch.Tensor] = []
        for begin, end in zip([start, *stops], [*stops, total]):
            chunk = torch.tensor([t[begin:end] for t in tokens], device=self.model.device)  # (count, end - begin)
            logits, _ = self.model(chunk, rows)  # (count, end - begin, V)
            pieces.append(logits)
            if end < total:
                for i, read in enumerate(tokens):
                    self._keep(read[:end], first + i, logits[i, -1])
        return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]

    def _keep(self, tokens: list[int], row: int, logits: torch.Tensor) -> None:
        """Row `row`'s state as it is now, after `tokens`, with its (V,) next-token logits, unless already kept."""
        assert self.prefix_cache is not None  # only a plan of the cache's stops here
        self.prefix_cache.keep(tokens, lambda: take_snapshot(self.slots.state, row, logits.float()))

    def _remember(self, request: GenerationRequest, row: int, likelihood: float) -> None:
        """Keep the state after the prompt, unless the cache already holds it; a weighed request's prompt
        likelihood goes with it."""
        if self.prefix_cache is None or not request.prompt:
            return
        tokens = self._read_tokens(request)
        snapshot = self.prefix_cache.keep(tokens, lambda: take_snapshot(self.slots.state, row, self.slots.logits[row]))
        if snapshot is not None and request.particles is not None:
            snapshot.likelihoods[_likelihood_key(request)] = likelihood

    def place_copies(self, places: list[Placement]) -> None:
        """Further samples and particles of a prompt copy its prefilled row, with their own seeds."""
        copies = [(place, place.copy_of) for place in places if place.copy_of is not None]
        if copies:
            self.slots.copy_rows([source for _, source in copies], [p.row for p, _ in copies])
            self.slots.sampling.seed[[p.row for p, _ in copies]] = torch.tensor(
                [p.seed for p, _ in copies], device=self.slots.position.device
            )

    def _run_prompts(self, requests: list[GenerationRequest], first: int, stops: tuple[int, ...]) -> torch.Tensor:
        """Prefill rows [first, first + len(requests)), one per request, with its lead (the start token, for models
        that read one first) and its prompt, storing their states after `stops` -> (count, lead + P, V) logits.
        Empty prompts (e.g. images with no known first pixel) copy the state after BOS alone, computed once at
        start-up, instead of running the model."""
        row_state = self.slots.state.slice(first, first + len(requests))
        if not requests[0].prompt:
            after_bos, logits = self._after_bos
            row_state.write_rows(range(len(requests)), after_bos)
            return logits[:, None].expand(len(requests), 1, -1)
        row_state.reset_rows(range(len(requests)))
        return self._read_in_pieces([self._read_tokens(r) for r in requests], first, 0, stops)

    def _prefill_bos(self) -> tuple[ModelState, torch.Tensor]:
        """The state after BOS alone and its next-token logits (1, V): where every empty prompt starts."""
        state = self.model.new_state(1)
        logits, _ = self.model(torch.tensor([[self.model.config.bos]], device=self.model.device), state)
        return state, logits[:, -1].float()

    def _fill_row(self, row: int, req: GenerationRequest) -> None:
        """A new sequence's per-row slots: position, known tokens, sampling parameters."""
        slots, s = self.slots, self.slots.sampling
        slots.position[row] = len(req.prompt)
        slots.forced[row] = -1
        if req.forced:  # one indexed write, not one per known pixel
            positions, values = zip(*req.forced.items())
            slots.forced[row, list(positions)] = torch.tensor(values, device=slots.forced.device)
        p = req.sampling
        s.temperature[row], s.top_k[row], s.top_p[row], s.seed[row] = p.temperature, p.top_k, p.top_p, p.seed
        if s.min_p is not None:  # allocated with the slots: every row has one
            s.min_p[row] = p.min_p
        eos = self.model.config.eos_token
        slots.fill_adjustments(row, req.prompt, p, eos if eos >= 0 else None)

    # -- a step -----------------------------------------------------------------
    def run_ahead(self, plan: SchedulerOutput) -> torch.Tensor:
        """One of a pass's unwatched steps (multi-step): draw and feed at once -> the (n,) tokens drawn."""
        tokens = self.sample(plan.rows, plan.needs).tokens
        self.decode(tokens)
        return tokens

    def execute(self, plan: SchedulerOutput, started: float, ahead: Sequence[torch.Tensor] = ()) -> RunnerOutput:
        """A pass's watched step, after the `ahead` tokens of its unwatched ones (`run_ahead`; the pass began at
        `started`): the known tokens' weights, then the draw. Its tokens are fed once finished rows have left
        (`apply`, then the next pass's `feed`)."""
        weights = self.known_logprobs(plan.known, plan.needs) if plan.known else []  # before sampling counts them
        drawn = self.sample(plan.rows, plan.needs)
        per_row = torch.stack([*ahead, drawn.tokens], dim=1) if ahead else drawn.tokens[:, None]  # (n, steps)
        return RunnerOutput(
            per_row.tolist(),
            drawn.tokens,
            _host(drawn.logprobs),
            _host(drawn.top_ids),
            _host(drawn.top_values),
            weights,
            started,
            time.monotonic(),
        )

    def apply(self, update: StepUpdate, output: RunnerOutput) -> AppliedStep:
        """Carry out what the scheduler made of `output`: copy the resampled rows, read the finished samples, move
        rows into the holes; the tokens to feed move with their rows and wait for `feed`."""
        tokens = output.last.clone() if update.copies or update.moves else output.last  # (n,) rows' next inputs
        self.copy_particles(update.copies, tokens)
        self._remember_finished(update)
        samples = self.read_samples(update.reads)
        self.move_rows(update.moves, tokens)
        self._unfed = tokens[: update.live]
        return AppliedStep(samples, self.state_bytes(update.live))

    def _remember_finished(self, update: StepUpdate) -> None:
        """Keep the state of each finished text row (no particles) after all it read, its generated tokens
        included, so a conversation's next turn, which repeats them, prefills only what is new. Before the rows
        move: a finished row's state is still its own."""
        if self.prefix_cache is None:
            return
        for i in update.outcome.finished:
            request: GenerationRequest = update.rows[i].owner.request
            if request.particles is None and request.prompt:
                self._remember_sequence(request, i)

    def _remember_sequence(self, request: GenerationRequest, row: int) -> None:
        """Row `row`'s state, keyed by every token it has read: its lead, prompt and the generated tokens fed."""
        assert self.prefix_cache is not None  # the caller checked
        read = self._read_tokens(request)
        fed = int(self.slots.state.lengths[row]) - len(read)  # generated tokens the state has read
        if fed <= 0:
            return  # nothing beyond the prompt, whose state is kept already
        start = len(request.prompt)
        tokens = [*read, *self.slots.generated[row, start : start + fed].tolist()]
        self.prefix_cache.keep(tokens, lambda: take_snapshot(self.slots.state, row, self.slots.logits[row]))

    def feed(self) -> None:
        """The last pass's tokens into its live rows (rows [0, live) after `apply`): their next logits to the slots.
        Rows admitted since sit past them and are left alone."""
        tokens, self._unfed = self._unfed, None
        if tokens is not None:
            self.decode(tokens)

    def drop_unfed(self) -> None:
        """Forget the last pass's tokens: their rows were cleared (a failed step)."""
        self._unfed = None

    def read_samples(self, reads: dict[int, SampleSpan]) -> dict[int, SampleRead]:
        """Finished rows' whole samples: row -> what to read in, row -> its read out."""
        return {row: self.read_sample(row, span.start, span.end, span.request) for row, span in reads.items()}

    def sample(self, n: int, needs: StepNeeds) -> Drawn:
        """Draw a token for rows [0, n) (known tokens kept), written by position with what the rows need."""
        slots = self.slots
        position = slots.position[:n]
        source = slots.penalized(n) if needs.adjust else slots.logits[:n]
        tokens = self.stepper.sample(
            source, slots.batch_sampling(n, needs.filters), position
        )  # compiled draw, once ready
        if needs.forced:
            tokens = force_tokens(tokens, slots.forced[:n].gather(1, position[:, None])[:, 0])
        slots.generated[:n].scatter_(1, position[:, None], tokens[:, None])
        if needs.adjust:
            slots.counts[:n].scatter_add_(1, tokens[:, None], torch.ones_like(slots.counts[:n, :1]))
            slots.seen[:n].scatter_(1, tokens[:, None], True)
        drawn = self._record_logprobs(Drawn(tokens), needs, position)
        position += 1
        return drawn

    def _record_logprobs(self, drawn: Drawn, needs: StepNeeds, position: torch.Tensor) -> Drawn:
        """Log-probabilities under the model's own distribution (before penalties), kept by position."""
        slots, n = self.slots, len(drawn.tokens)
        logits = slots.logits[:n]
        if needs.logprobs:
            drawn.logprobs = token_logprobs(logits, drawn.tokens)
            slots.logprobs[:n].scatter_(1, position[:, None], drawn.logprobs[:, None])
        if needs.top:
            drawn.top_ids, drawn.top_values = top_logprobs(logits, MAX_TOP_LOGPROBS)
            rows = torch.arange(n, device=position.device)
            slots.top_ids[rows, position], slots.top_values[rows, position] = drawn.top_ids, drawn.top_values
        return drawn

    def known_logprobs(self, rows: list[int], needs: StepNeeds) -> list[float]:
        """Log-probability of the known token each of `rows` is about to take, under the distribution it
        would otherwise draw from: the particles' weights. Called before `sample` counts the token."""
        slots = self.slots
        logits = slots.adjusted(rows) if needs.adjust else slots.logits[rows]  # (R, V)
        known = slots.forced[rows].gather(1, slots.position[rows][:, None])[:, 0]  # (R,)
        return sampling_logprobs(logits, slots.batch_sampling(rows, needs.filters), known).tolist()

    def copy_particles(self, copies: list[RowCopy], tokens: torch.Tensor) -> None:
        """Resampling: each copy's row takes its source's state, history and token (in `tokens`, the runner's
        own), and a seed of its own."""
        if not copies:
            return
        src, dst = [c.src for c in copies], [c.dst for c in copies]
        self.slots.copy_rows(src, dst)
        tokens[dst] = tokens[src]
        self.slots.sampling.seed[dst] = torch.tensor([c.seed for c in copies], device=tokens.device)

    def move_rows(self, moves: list[tuple[int, int]], tokens: torch.Tensor) -> None:
        """Apply the scheduler's compaction, its (src, dst) rows with their drawn tokens in one indexed copy per
        tensor (no row is both a source and a destination)."""
        if moves:
            src, dst = (list(rows) for rows in zip(*moves))
            self.slots.copy_rows(src, dst)
            tokens[dst] = tokens[src]

    def decode(self, tokens: torch.Tensor) -> None:
        """Feed rows [0, len(tokens)) their drawn tokens: their next logits go to the slots."""
        if len(tokens):
            self.slots.logits[: len(tokens)] = self.stepper(tokens)

    def read_sample(
        self, row: int, start: int, end: int, request: GenerationRequest
    ) -> tuple[list[int], list[float] | None, list[TopLogprobs] | None]:
        """A row's tokens at positions [start, end), with the log-probabilities it asked for, in one read."""
        logprobs = self.slots.logprobs[row, start:end].tolist() if request.wants_logprobs else None
        top = None
        if request.top_logprobs:
            k = request.top_logprobs
            top = pair_up(self.slots.top_ids[row, start:end, :k], self.slots.top_values[row, start:end, :k])
        return self.slots.generated[row, start:end].tolist(), logprobs, top

    def state_bytes(self, rows: int) -> int:
        return self.slots.state.nbytes_in_use(rows)

    def score(self, tokens: list[int], top: int = 0) -> PromptScores:
        """Log-probability of each token given those before it, one parallel pass, and the `top` most likely
        tokens at each position. A model that reads its start token first scores the first token given it;
        otherwise nothing predicts the first token, whose entries are None (as in OpenAI's API)."""
        x = torch.tensor([tokens], device=self.model.device)
        if self.model.config.reads_bos_first:  # (T, V): position t predicts token t
            logits, predicted, unscored = self.model(with_bos(x, self.model.config.bos))[0][0], x[0], []
        else:  # (T - 1, V): position t predicts token t + 1
            logits, predicted, unscored = self.model(x)[0][0, :-1], x[0, 1:], [None]
        scores = PromptScores([*unscored, *token_logprobs(logits, predicted).tolist()])
        if top:
            scores.top_logprobs = [*unscored, *pair_up(*top_logprobs(logits, top))]
        return scores


def snapshot_policy(model: Transformer, every: int, budget: int) -> SnapshotPolicy:
    """Where the model's prefills store states mid-prompt, in a prefix cache of `budget` bytes: periodic snapshots
    (the first after `every` tokens read) for a constant-size state only, and none when the budget holds no more
    than a prompt's end state; a state kept by position serves branch points from longer snapshots."""
    truncates = all(layer.snapshots_truncate for layer in model.new_state(1).layers)
    if not model.capabilities.constant_state:
        return SnapshotPolicy(0, truncates)
    states = budget // (model.state_bytes_per_sequence() + LOGIT_BYTES * model.config.vocab_out)
    return SnapshotPolicy(every if states > 1 else 0, truncates, states)


def caches_prefixes(model: Transformer) -> bool:
    """Whether the model's decode state can be snapshot at any prefix exactly (every kind's declares it)."""
    return all(layer.snapshots_exact for layer in model.new_state(1).layers)


def _likelihood_key(request: GenerationRequest) -> tuple[float, ...]:
    """What a prompt's log-likelihood under a request's sampling distribution depends on besides its tokens."""
    p = request.sampling
    return (p.temperature, p.top_k, p.top_p, p.min_p)


def prompt_log_likelihood(logits: torch.Tensor, request: GenerationRequest) -> float:
    """log p(prompt) under the request's sampling distribution: (lead + P - 1, V) logits, each predicting the
    next token (without a lead, nothing predicts the prompt's first token)."""
    p = request.sampling
    predicted = request.prompt[len(request.prompt) - logits.shape[0] :]
    params = BatchSampling.from_params([p] * len(predicted), logits.device)
    tokens = torch.tensor(predicted, device=logits.device)
    return float(sampling_logprobs(logits, params, tokens).double().sum())


def pair_up(ids: torch.Tensor, values: torch.Tensor) -> list[TopLogprobs]:
    """(T, k) ids and log-probabilities -> per position, [(token, logprob), ...] most likely first."""
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def _host(values: torch.Tensor | None) -> Any:
    return values.tolist() if values is not None else None
