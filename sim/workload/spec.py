"""Benchmark workloads as ``vllm bench serve`` and ``sglang.bench_serving`` define them.

A workload is the list of requests a benchmark client sends and when it may send them:

    dataset      each request's input (prompt) and output length in tokens
                 ``fixed``          every request ``isl`` in, ``osl`` out
                 ``random``         ``--dataset-name random``: lengths drawn uniformly from the
                                    integers of the benchmark client's range (``BENCH_CLIENTS``)
                                    for ``L = isl`` / ``osl`` and ``r = --random-range-ratio``:
                                    vLLM's ``[floor(L(1 - r)), ceil(L(1 + r))]``, r in ``[0, 1)``
                                    (``r = 0`` is ``fixed``); SGLang's ``[int(rL), L]``, r in
                                    ``[0, 1]`` (``r = 1`` is ``fixed``); output at least 1
                 ``sharegpt-like``  a synthetic heavy-tailed distribution standing in for the
                                    ShareGPT conversations (``SHAREGPT_LIKE``), or, with a local
                                    ShareGPT JSON (``dataset_path``), its first-turn prompt and
                                    answer lengths; both filtered as vLLM filters ShareGPT
                 ``trace``          a request trace's lengths *and arrival times*
                                    (``sim/workload/traces.py``: Azure's CSV columns, a file or a
                                    shipped name), the first ``num_prompts`` rows (all by
                                    default), arrivals scaled by ``time_scale``; the open loop's
                                    rate and burstiness do not apply, a concurrency cap still does
    arrivals     closed loop: ``max_concurrency`` requests in flight at most (a new one is sent
                 when one finishes); open loop: ``request_rate`` requests/s with exponential
                 (Poisson, ``burstiness`` 1) or gamma gaps, or ``inf`` (all sent at time 0).
                 vLLM combines them: requests are generated at the rate and then wait for a free
                 concurrency slot; a request's clock (TTFT, E2E) starts when it gets the slot.

Output lengths are always exact: the simulator generates exactly the requested number of tokens,
which is what ``--ignore-eos`` guarantees on a real server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from epsim.model.config import ModelConfig, check_context_length
from epsim.model.errors import EpsimError, read_json_file

from .traces import SHIPPED_TRACES, trace_head

DATASETS = ("fixed", "random", "sharegpt-like", "trace")


@dataclass(frozen=True)
class BenchClient:
    """How one benchmark client reads ``--random-range-ratio r`` (its random dataset's lengths).

    name: the client. ratio_max / ratio_max_open: r's upper bound (open: r must stay below it).
    symmetric: lengths in ``[floor(L(1 - r)), ceil(L(1 + r))]`` (vLLM) rather than
        ``[int(rL), L]`` (SGLang).
    source: the client's code that draws them.
    """

    name: str
    ratio_max: float
    ratio_max_open: bool
    symmetric: bool
    source: str

    def length_range(self, length: int, ratio: float, minimum: int = 1) -> tuple[int, int]:
        """The integers a random-dataset length ``L`` is drawn from -> (low, high)."""
        if self.symmetric:
            low = max(minimum, math.floor(length * (1.0 - ratio)))
            return low, max(low, math.ceil(length * (1.0 + ratio)))
        # SGLang's output low is int(rL), 0 at r < 1/L; epsim's requests emit at least one token
        return max(minimum, int(length * ratio)), length

    def check_ratio(self, ratio: float) -> None:
        above = ratio >= self.ratio_max if self.ratio_max_open else ratio > self.ratio_max
        if not 0.0 <= ratio or above:
            right = ")" if self.ratio_max_open else "]"
            raise EpsimError(f"random-range-ratio must be in [0, {self.ratio_max:g}{right} for "
                             f"--bench-client {self.name}, got {ratio}")


#: the benchmark clients whose flags epsim reads (``--bench-client``), vLLM's the default
BENCH_CLIENTS: dict[str, BenchClient] = {
    "vllm": BenchClient(
        "vllm", 1.0, True, True,
        "vllm-project/vllm vllm/benchmarks/datasets.py at 0056b87f, "
        "RandomDataset.get_sampling_params"),
    "sglang": BenchClient(
        "sglang", 1.0, False, False,
        "sgl-project/sglang python/sglang/bench_serving.py at 0033168f, sample_random_requests"),
}
DEFAULT_BENCH_CLIENT = "vllm"


@dataclass(frozen=True)
class ShareGPTLike:
    """Parameters of the synthetic ShareGPT-like length distribution (log-normal, then filtered).

    input_mean / output_mean: mean prompt and answer tokens before filtering. Example: 161.31 /
        337.99, the ShareGPT means the vLLM paper reports (Kwon et al., "Efficient Memory
        Management for Large Language Model Serving with PagedAttention", SOSP 2023, section 6.1).
    input_sigma / output_sigma: log-space standard deviations (epsim's assumption, not fitted:
        ShareGPT lengths span about two orders of magnitude).
    min_len / max_prompt_len / max_total_len: vLLM's ShareGPT filter (``is_valid_sequence``):
        drop pairs with a prompt or answer under 4 tokens, a prompt over 1024 or a total over 2048.
    """

    input_mean: float = 161.31
    output_mean: float = 337.99
    input_sigma: float = 1.0
    output_sigma: float = 0.9
    min_len: int = 4
    max_prompt_len: int = 1024
    max_total_len: int = 2048


SHAREGPT_LIKE = ShareGPTLike()

#: characters per token used to size a local ShareGPT file's texts without a tokenizer (the
#: usual rule of thumb for English text under BPE tokenizers)
CHARS_PER_TOKEN = 4.0


@dataclass(frozen=True)
class WorkloadSpec:
    """What the benchmark client sends.

    dataset: ``"fixed"``, ``"random"``, ``"sharegpt-like"`` or ``"trace"``.
    num_prompts: requests in the benchmark. Example: 4096. For ``trace``: its first rows
        (``None``, only there: every row).
    isl / osl: input / output tokens (fixed, random); for sharegpt-like ``osl`` (when given) fixes
        every answer's length as vLLM's ``--sharegpt-output-len`` does. Example: 2000 / 100.
    random_range_ratio: ``r`` of the random dataset, as ``bench_client`` reads it.
    max_concurrency: closed-loop cap on requests in flight (``None``: no cap).
    request_rate: requests/s of the open loop; ``math.inf`` sends everything at time 0.
    burstiness: gamma shape of the inter-arrival gaps (1: Poisson), as vLLM's ``--burstiness``.
    dataset_path: a local ShareGPT JSON for ``sharegpt-like`` (``None``: the synthetic one);
        the request trace for ``trace`` (a CSV or a shipped name, e.g. ``"azure-conv"``).
    time_scale: ``trace`` only: arrival times multiplied by this (0.5: twice the rate).
    seed: seeds every random choice. Same seed, same requests.
    bench_client: whose ``--random-range-ratio`` this is (``BENCH_CLIENTS``). Example: "sglang".
    """

    dataset: str = "fixed"
    num_prompts: int | None = 1000
    isl: int | None = None
    osl: int | None = None
    random_range_ratio: float = 0.0
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    dataset_path: str | None = None
    time_scale: float = 1.0
    seed: int = 0
    bench_client: str = DEFAULT_BENCH_CLIENT

    @property
    def client(self) -> BenchClient:
        return BENCH_CLIENTS[self.bench_client]

    def validate(self) -> WorkloadSpec:
        """Check every field; raise :class:`EpsimError` naming the bad value."""
        if self.dataset not in DATASETS:
            raise EpsimError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.dataset == "trace":
            self._validate_trace()
        elif self.num_prompts is None:
            raise EpsimError("num-prompts may be omitted only for --dataset trace")
        elif self.time_scale != 1.0:
            raise EpsimError("--time-scale stretches a trace's arrivals; use it with "
                             "--dataset trace")
        if self.num_prompts is not None and (isinstance(self.num_prompts, bool)
                                             or not isinstance(self.num_prompts, int)
                                             or self.num_prompts < 1):
            raise EpsimError(f"num-prompts must be a positive integer, got {self.num_prompts!r}")
        if self.dataset in ("fixed", "random"):
            for name in ("isl", "osl"):
                value = getattr(self, name)
                if value is None:
                    raise EpsimError(f"the {self.dataset} dataset needs --{name}")
        for name in ("isl", "osl"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise EpsimError(f"{name} must be a positive integer, got {value!r}")
        if self.dataset == "sharegpt-like" and self.isl is not None:
            raise EpsimError("the sharegpt-like dataset draws prompt lengths; drop --isl "
                             "(or use --dataset fixed/random)")
        if self.bench_client not in BENCH_CLIENTS:
            raise EpsimError(f"bench-client must be one of {', '.join(BENCH_CLIENTS)}, got "
                             f"{self.bench_client!r}")
        self.client.check_ratio(self.random_range_ratio)
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise EpsimError(f"concurrency must be a positive integer, got {self.max_concurrency}")
        if not (self.request_rate > 0):
            raise EpsimError(f"request-rate must be positive or inf, got {self.request_rate}")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise EpsimError(f"burstiness must be a positive number, got {self.burstiness}")
        if self.dataset_path is not None and self.dataset not in ("sharegpt-like", "trace"):
            raise EpsimError("--dataset-path is a ShareGPT JSON (--dataset sharegpt-like) or a "
                             "request trace (--dataset trace)")
        if self.dataset == "sharegpt-like" and self.dataset_path in SHIPPED_TRACES:
            raise EpsimError(f"{self.dataset_path} is a shipped request trace; use it with "
                             "--dataset trace")
        return self

    def _validate_trace(self) -> None:
        """A trace brings lengths and arrival times: the flags that would set them contradict."""
        if self.dataset_path is None:
            raise EpsimError("--dataset trace needs --dataset-path (a CSV with TIMESTAMP, "
                             f"ContextTokens, GeneratedTokens, or {', '.join(SHIPPED_TRACES)})")
        for name in ("isl", "osl"):
            if getattr(self, name) is not None:
                raise EpsimError(f"the trace dataset brings each request's lengths; drop --{name}")
        if not math.isinf(self.request_rate) or self.burstiness != 1.0:
            raise EpsimError("the trace dataset brings its own arrival times; drop "
                             "--request-rate / --burstiness (--time-scale stretches them)")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise EpsimError(f"time-scale must be a positive number, got {self.time_scale}")


@dataclass(frozen=True)
class Requests:
    """The sampled requests, as arrays of length ``num_prompts`` (index = request id).

    input_lens / output_lens: tokens in and out (int64). Example: ``[2000, 2000, ...]``.
    issue_times_s: when the client generates each request (the open loop's schedule; all 0 for
        ``request_rate = inf``); under a concurrency cap it is sent when a slot is free too.
    """

    input_lens: np.ndarray
    output_lens: np.ndarray
    issue_times_s: np.ndarray

    def __len__(self) -> int:
        return len(self.input_lens)


def random_length_range(length: int, ratio: float, minimum: int = 1,
                        client: str = DEFAULT_BENCH_CLIENT) -> tuple[int, int]:
    """The lengths the random dataset draws from -> (low, high): vLLM's
    ``[floor(L(1-r)), ceil(L(1+r))]`` or SGLang's ``[int(rL), L]`` (``BENCH_CLIENTS``)."""
    return BENCH_CLIENTS[client].length_range(length, ratio, minimum)


def random_lengths(rng: np.random.Generator, n: int, length: int, ratio: float,
                   minimum: int = 1, client: str = DEFAULT_BENCH_CLIENT) -> np.ndarray:
    """``n`` integer lengths uniform over ``random_length_range`` (the client's rule) -> (n,)."""
    low, high = random_length_range(length, ratio, minimum, client)
    return rng.integers(low, high + 1, size=n, dtype=np.int64)


def _lognormal_for_mean(rng: np.random.Generator, n: int, mean: float, sigma: float) -> np.ndarray:
    """Log-normal draws with the given arithmetic mean: mu = ln(mean) - sigma^2 / 2."""
    mu = math.log(mean) - sigma * sigma / 2.0
    return rng.lognormal(mu, sigma, size=n)


def _valid_pairs(ins: np.ndarray, outs: np.ndarray, p: ShareGPTLike, fixed_out: bool) -> np.ndarray:
    """vLLM's ShareGPT filter as a boolean mask over candidate (prompt, answer) pairs."""
    ok = (ins >= p.min_len) & (ins <= p.max_prompt_len) & (ins + outs <= p.max_total_len)
    if not fixed_out:  # an answer length the user fixed is not filtered (as in vLLM)
        ok &= outs >= p.min_len
    return ok


def sharegpt_like_lengths(rng: np.random.Generator, n: int, osl: int | None = None,
                          params: ShareGPTLike = SHAREGPT_LIKE) -> tuple[np.ndarray, np.ndarray]:
    """``n`` synthetic ShareGPT-like (prompt, answer) lengths -> two (n,) int64 arrays.

    Steps: draw log-normal candidates in batches, round to tokens, keep the pairs vLLM's filter
    keeps, stop at ``n``.
    """
    ins_out: list[np.ndarray] = []
    outs_out: list[np.ndarray] = []
    have = 0
    if osl is not None and osl + params.min_len > params.max_total_len:
        raise EpsimError(f"osl {osl} leaves no room under the ShareGPT filter's "
                         f"{params.max_total_len}-token total")
    while have < n:
        batch = max(2 * (n - have), 64)
        ins = np.maximum(1, np.rint(_lognormal_for_mean(rng, batch, params.input_mean,
                                                        params.input_sigma))).astype(np.int64)
        if osl is None:
            outs = np.maximum(1, np.rint(_lognormal_for_mean(
                rng, batch, params.output_mean, params.output_sigma))).astype(np.int64)
        else:
            outs = np.full(batch, osl, dtype=np.int64)
        keep = _valid_pairs(ins, outs, params, osl is not None)
        ins_out.append(ins[keep])
        outs_out.append(outs[keep])
        have += int(keep.sum())
    return np.concatenate(ins_out)[:n], np.concatenate(outs_out)[:n]


def _token_estimate(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def sharegpt_file_lengths(path: str, rng: np.random.Generator, n: int, osl: int | None = None,
                          params: ShareGPTLike = SHAREGPT_LIKE) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, answer) lengths from a local ShareGPT JSON, as vLLM samples it -> two (n,) arrays.

    Steps: keep conversations with at least two turns; prompt = first turn, answer = second
    (tokens estimated as characters / ``CHARS_PER_TOKEN``, there being no tokenizer here);
    shuffle with the seed; apply vLLM's filter; take the first ``n`` (cycling when the file has
    fewer valid pairs, as vLLM's oversampling does).
    """
    file = Path(path)
    data = read_json_file(file, "ShareGPT dataset file")
    if not isinstance(data, list):
        raise EpsimError(f"{file}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        pairs.append((_token_estimate(str(first.get("value", ""))),
                      _token_estimate(str(second.get("value", "")))))
    if not pairs:
        raise EpsimError(f"{file}: no conversation with two turns (ShareGPT format expected)")
    arr = np.array(pairs, dtype=np.int64)[rng.permutation(len(pairs))]
    ins = arr[:, 0]
    outs = arr[:, 1] if osl is None else np.full(len(arr), osl, dtype=np.int64)
    keep = _valid_pairs(ins, outs, params, osl is not None)
    if not keep.any():
        raise EpsimError(f"{file}: no prompt/answer pair passes the ShareGPT length filter")
    ins, outs = ins[keep], outs[keep]
    reps = math.ceil(n / len(ins))
    return np.tile(ins, reps)[:n], np.tile(outs, reps)[:n]


def issue_times(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    """When the client generates each request -> (n,) seconds, first at 0.

    ``rate = inf``: all at 0. Else gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)),
    exponential (Poisson arrivals) at burstiness 1, as in vLLM's ``get_request``.
    """
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def longest_request(spec: WorkloadSpec, params: ShareGPTLike = SHAREGPT_LIKE
                    ) -> tuple[int, str]:
    """The longest prompt + output the dataset can produce, whatever the seed, and what that is
    in the user's terms (for an error message).

    fixed: ``isl + osl``; random: the top of both ranges; sharegpt-like (synthetic or a file):
    the ShareGPT filter's total cap, which every kept pair stays under.
    """
    if spec.dataset == "fixed":
        return spec.isl + spec.osl, f"--isl {spec.isl} + --osl {spec.osl}"
    if spec.dataset == "random":
        c = spec.bench_client
        top = (random_length_range(spec.isl, spec.random_range_ratio, client=c)[1]
               + random_length_range(spec.osl, spec.random_range_ratio, client=c)[1])
        return top, (f"the random dataset's longest request (--isl {spec.isl} + --osl "
                     f"{spec.osl} at range ratio {spec.random_range_ratio:g})")
    if spec.dataset == "trace":
        trace = trace_head(spec.dataset_path, spec.num_prompts)
        total = trace.input_lens + trace.output_lens
        i = int(total.argmax())
        return int(total[i]), (f"request {i} of the trace {spec.dataset_path} "
                               f"({int(trace.input_lens[i])} in + {int(trace.output_lens[i])} out)")
    return params.max_total_len, "the sharegpt-like dataset's longest request (its filter's total cap)"


def max_request_tokens(spec: WorkloadSpec, params: ShareGPTLike = SHAREGPT_LIKE) -> int:
    """The longest prompt + output the dataset can produce (:func:`longest_request`)."""
    return longest_request(spec, params)[0]


def check_context(spec: WorkloadSpec, model: ModelConfig) -> None:
    """Refuse a dataset that can produce a request beyond the model's context, in one line."""
    check_context_length(model, *longest_request(spec))


def check_requests_context(req: Requests, model: ModelConfig) -> None:
    """Refuse given requests (a replayed benchmark's) of which one exceeds the model's context."""
    if len(req):
        i = int(np.argmax(req.input_lens + req.output_lens))
        check_context_length(model, int(req.input_lens[i] + req.output_lens[i]),
                             f"request {i} ({int(req.input_lens[i])} in + "
                             f"{int(req.output_lens[i])} out)")


def sample_requests(spec: WorkloadSpec, model: ModelConfig | None = None) -> Requests:
    """Draw the benchmark's requests from ``spec`` (deterministic in ``spec.seed``).

    With ``model``, a dataset that can produce a request longer than the model's context
    (``max_position_embeddings``) is refused before anything is drawn.
    """
    spec.validate()
    if model is not None:
        check_context(spec, model)
    if spec.dataset == "trace":
        trace = trace_head(spec.dataset_path, spec.num_prompts)
        return Requests(input_lens=trace.input_lens, output_lens=trace.output_lens,
                        issue_times_s=trace.arrival_s * spec.time_scale)
    rng = np.random.default_rng(spec.seed)
    n = spec.num_prompts
    if spec.dataset == "fixed":
        ins = np.full(n, spec.isl, dtype=np.int64)
        outs = np.full(n, spec.osl, dtype=np.int64)
    elif spec.dataset == "random":
        ins = random_lengths(rng, n, spec.isl, spec.random_range_ratio, client=spec.bench_client)
        outs = random_lengths(rng, n, spec.osl, spec.random_range_ratio, client=spec.bench_client)
    elif spec.dataset_path:
        ins, outs = sharegpt_file_lengths(spec.dataset_path, rng, n, spec.osl)
    else:
        ins, outs = sharegpt_like_lengths(rng, n, spec.osl)
    times = issue_times(rng, n, spec.request_rate, spec.burstiness)
    return Requests(input_lens=ins, output_lens=outs, issue_times_s=times)
