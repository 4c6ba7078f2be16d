"""Dynamic speculation depth: how many drafts each request gets this step, down to 0.

The rule: a step's expected output tokens per second of execute time, maximised (the
speculation trade-off of Leviathan et al. 2023, section 3.3, with the step cost measured
instead of assumed).

* ``t(T)``: the execute time of a decode-only step of ``T`` tokens, measured online from the
  engine's own steps (``observe``: per ``T``, an exponential average), linear between measured
  ``T``; past the largest measured ``T`` it grows with the slope of the last two measured counts
  (at least 1% per token), or by ``PRIOR_SLOPE`` of its value per token while only one is known
  (optimistic on purpose: a probe then measures it).
* A request whose drafts are accepted with probability ``alpha`` each (an exponential average of
  its own verdicts, from ``PRIOR_ALPHA``) expects ``E(k) = alpha + ... + alpha ** k`` extra tokens
  from ``k`` drafts. In a step of ``B`` decodes it gets the ``k`` maximising
  ``(B + E(k)) / t(B + k)``, 0 when none beats ``B / t(B)``.
* Under async scheduling step ``N + 1`` is planned while step ``N`` runs, so a request whose
  drafts are in step ``N`` cannot be in step ``N + 1`` (its verdict moves its position): beside
  other decodes that step loses its token, so drafts must earn ``E(k) - 1``. A request with a
  step in flight gets its drafts by sitting one step out first (``scheduler.HOLD``, ``sit_out``)
  and then misses the step after its drafts too: ``E(k) - 2``. Alone, a skipped step costs no
  token (nothing else would run in it). Without the sit-out's token, 16 concurrent requests lost
  7-14% to probes and sit-outs (``benchmarks/spec_decode.py``); the step after the drafts was
  left out of the rule until the async flag reached it (``async_scheduling``).

* The extra time drafts add to a step counts ``DRAFT_COST_MARGIN`` (1.25) times: near the
  break-even point the estimate is within its own noise (step times move by 10% on a busy
  2-core VM), and what ``t`` leaves out (host-side verification, the batches that sit-outs
  reshuffle) turned predicted gains of a few percent into losses: float32 SmolLM2 at 16
  concurrent requests, where a 33-token step costs 1.9x a 16-token one, ran at 0.89x when
  drafts were planned on any predicted gain. Where drafting clearly pays (batch 1, or a
  memory-bound device where a bigger step costs little more) the margin changes nothing.
* A proposer that runs a model (``draft_model``) costs time too: ``proposer_step_s``, the
  measured seconds of one batched draft forward, and a step whose deepest request drafts ``k``
  runs ``k`` of them (one catch-up, ``k - 1`` decodes) whatever the batch, so the step's time is
  ``t(B + K) + K * proposer_step_s`` with ``K`` the largest depth planned in it (0 for the
  token-matching proposers, and until step times are measured: the prior ``t`` has no unit).

So a lone request on a memory-bound device (where ``t`` barely grows with ``T``) speculates as deep
as its acceptance pays for, and stops when its drafts are refused; on a compute-bound step
(large batches; a CPU whose multi-token steps cost several single ones) nothing is worth its
compute and ``k`` stays 0. A request at 0 probes once every ``PROBE_EVERY`` steps with the full
depth, but only while the measured costs say full acceptance would pay: a change of regime
(the output starts quoting its prompt) is noticed, and a device where speculation cannot win
stops paying for probes once it has measured that.
"""

from __future__ import annotations

PRIOR_ALPHA = 0.6     # a new request's acceptance before any verdict
ALPHA_DECAY = 0.7     # weight of the past in the acceptance average, per judged draft
PRIOR_SLOPE = 0.05    # unmeasured step growth per extra token, relative (memory-bound guess)
STEP_DECAY = 0.8      # weight of the past in each token count's step time
MIN_SAMPLES = 2       # steps before a token count's time is trusted
PROBE_EVERY = 16
DRAFT_COST_MARGIN = 1.25  # the drafts' extra step time, as the rule counts it (module docstring)


class DepthController:
    """Per request acceptance and the measured step cost (module docstring).

    Args:
        max_k: ``num_speculative_tokens``.
        dynamic: ``False``: always ``max_k``.
        async_scheduling: the engine plans a step while the previous one runs, so drafting beside
            other decodes costs the request the next step (module docstring).
    """

    def __init__(self, max_k: int, dynamic: bool = True, async_scheduling: bool = False) -> None:
        self.max_k, self.dynamic, self.async_scheduling = max_k, dynamic, async_scheduling
        self.alpha: dict[str, float] = {}
        self._since_probe: dict[str, int] = {}
        self._times: dict[int, list[float]] = {}  # tokens per step -> [mean seconds, samples]
        self._planned, self._planned_gain = 0, 0.0  # drafts planned in the step being planned
        self._planned_depth = 0  # the deepest request's drafts in the step being planned
        self.proposer_step_s = 0.0  # seconds per draft forward of a model proposer (module docstring)
        self._curve: dict[int, float] = {}  # step_time's answers since the last observe (asked ~10x per request per step)

    def step_time(self, num_tokens: int) -> float:
        """Estimated execute seconds of a decode-only step of ``num_tokens`` (1.0 per step before
        any measurement: only ratios matter)."""
        cached = self._curve.get(num_tokens)
        if cached is None:
            cached = self._curve[num_tokens] = self._interpolate(num_tokens)
        return cached

    def _interpolate(self, num_tokens: int) -> float:
        known = sorted((t, s[0]) for t, s in self._times.items() if s[1] >= MIN_SAMPLES)
        if not known:
            return 1.0 + PRIOR_SLOPE * (num_tokens - 1)
        lo = max(((t, y) for t, y in known if t <= num_tokens), default=None)
        hi = min(((t, y) for t, y in known if t >= num_tokens), default=None)
        if lo is not None and hi is not None:
            if hi[0] == lo[0]:
                return lo[1]
            return lo[1] + (hi[1] - lo[1]) * (num_tokens - lo[0]) / (hi[0] - lo[0])
        if lo is None:  # below every measured count: scale the smallest down by the prior slope
            t0, y0 = known[0]
            return y0 / (1 + PRIOR_SLOPE * (t0 - num_tokens))
        t0, y0 = known[-1]
        slope = y0 * PRIOR_SLOPE
        if len(known) >= 2:  # past the largest measured count: the slope of the last two, at least 1% per token
            (t1, y1) = known[-2]
            slope = max((y0 - y1) / (t0 - t1), 0.01 * y0)
        return y0 + slope * (num_tokens - t0)

    def _draft_time(self, k: int) -> float:
        """Seconds the proposer adds to a step whose request drafts ``k`` (module docstring)."""
        if not self.proposer_step_s or not any(s[1] >= MIN_SAMPLES for s in self._times.values()):
            return 0.0
        return max(k, self._planned_depth) * self.proposer_step_s

    def _best(self, alpha: float, tokens: int, expected: float, penalty: float = 0.0) -> int:
        base = self.step_time(tokens) + self._draft_time(0)
        best_k, best = 0, expected / base
        gain = -penalty
        for k in range(1, self.max_k + 1):
            gain += alpha ** k
            # the drafts' extra time counts DRAFT_COST_MARGIN times (module docstring)
            cost = base + DRAFT_COST_MARGIN * (self.step_time(tokens + k) + self._draft_time(k) - base)
            value = (expected + gain) / cost
            if value > best:
                best_k, best = k, value
        return best_k

    def begin_step(self) -> None:
        """A new step is being planned: no drafts in it yet."""
        self._planned, self._planned_gain, self._planned_depth = 0, 0.0, 0

    def estimate(self, request_id: str, batch_size: int) -> int:
        """The depth ``depth`` would give the request as the step's first (nothing planned yet),
        without counting toward its probe: what a batched proposer drafts ahead (0 .. ``max_k``)."""
        if not self.dynamic:
            return self.max_k
        saved = self._planned, self._planned_gain, self._planned_depth
        self._planned, self._planned_gain, self._planned_depth = 0, 0.0, 0
        try:
            k = self._best(self.alpha.get(request_id, PRIOR_ALPHA), batch_size, batch_size)
            if not k and self._since_probe.get(request_id, 0) + 1 >= PROBE_EVERY \
                    and self._best(1.0, batch_size, batch_size) > 0:
                k = self.max_k
        finally:
            self._planned, self._planned_gain, self._planned_depth = saved
        return k

    def depth(self, request_id: str, batch_size: int, sit_out: bool = False) -> int:
        """Drafts to ask for this step (0 .. ``max_k``) for a request in a step of ``batch_size`` decodes,
        counting the drafts already planned for the step's earlier requests (``planned``) in its
        tokens and their expected kept tokens in its output; ``sit_out``: the request has a step in
        flight, so drafting costs it this step's token when others decode (module docstring)."""
        if not self.dynamic:
            return self.max_k
        tokens = batch_size + self._planned
        expected = batch_size + self._planned_gain
        alpha = self.alpha.get(request_id, PRIOR_ALPHA)
        penalty = float(self.skipped_steps(batch_size, sit_out))
        k = self._best(alpha, tokens, expected, penalty)
        if not k:
            n = self._since_probe.get(request_id, 0) + 1
            self._since_probe[request_id] = n
            if n >= PROBE_EVERY and self._best(1.0, tokens, expected, penalty) > 0:
                self._since_probe[request_id] = 0
                k = self.max_k
        return k

    def skipped_steps(self, batch_size: int, sit_out: bool) -> int:
        """Steps beside other decodes that drafting this step costs the request (module docstring):
        the sit-out (``sit_out``) and, under async scheduling, the step after its drafts."""
        if batch_size <= 1:
            return 0
        return int(sit_out) + int(self.async_scheduling)

    def planned(self, request_id: str, num_drafts: int) -> None:
        """``num_drafts`` drafts were scheduled for the request in the step being planned."""
        if num_drafts:
            alpha = self.alpha.get(request_id, PRIOR_ALPHA)
            self._planned = self._planned + num_drafts
            self._planned_depth = max(self._planned_depth, num_drafts)
            self._planned_gain = self._planned_gain + sum(alpha ** i for i in range(1, num_drafts + 1))

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Update the request's acceptance with one verified step (``num_accepted`` of ``num_drafts``:
        the first ``num_accepted`` were accepted, the next, if any, rejected; later ones unjudged)."""
        alpha = self.alpha.get(request_id, PRIOR_ALPHA)
        for i in range(min(num_drafts, num_accepted + 1)):
            alpha = ALPHA_DECAY * alpha + (1 - ALPHA_DECAY) * (1.0 if i < num_accepted else 0.0)
        self.alpha[request_id] = alpha

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One decode-only step of ``num_tokens`` tokens took ``seconds`` to execute."""
        self._curve.clear()
        s = self._times.setdefault(num_tokens, [seconds, 0])
        s[0] = seconds if s[1] == 0 else STEP_DECAY * s[0] + (1 - STEP_DECAY) * seconds
        s[1] += 1

    def finish(self, request_id: str) -> None:
        """Forget a finished request."""
        self.alpha.pop(request_id, None)
        self._since_probe.pop(request_id, None)
