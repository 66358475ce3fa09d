"""The compiled CPU decode path (model/decode/compiled/decoder.py) against the eager one.

Compiling takes seconds per graph here, so the tests use tiny models
(`make_tiny_model`), and share them where they only decode
(`shared_tiny_model`): each model's steps run a decode twin of its own
(model/kernels/packed_linear.py), which dynamo compiles again for.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch._inductor.config

from model.decode.compiled.background import BACKGROUND_COMPILE_NICENESS
from model.decode.compiled.decoder import CompiledDecoder
from model.decode.compiled.routing import MANY_ROWS
from model.decode.eager_and_cuda_graphs import EagerDecoder
from model.decode.choice import make_decoder
from model.decode.generate import generate
from model.decode.sampling import BatchSampling, SamplingParams
from model.kernels.cpu_features import read_cpu_features
from model.kernels.loader import cpu_route, packed_linear_wins
from model.kernels.packed_linear import DecodeTwins, PackedLinear, decode_twin
from model.attention.classes import kinds_where
from model.io.weights import load_model

from conftest import COMPILABLE_KINDS, assert_bfloat16_close, make_tiny_model, random_bytes, shared_tiny_model
from server_support import eager_generation, free_port, save_tiny_model, stop_process, token_bytes, wait_healthy

ROWS = 8
LOGPROB_TOLERANCE = 1e-4
REPO = Path(__file__).resolve().parents[1]


def compiled_decoder(
    model, rows: int = ROWS, require_captured: bool = True, batch: int | None = None
) -> CompiledDecoder:
    """A decoder whose steps run its compiled graphs, even for a model whose steps could be one C++ call
    (tests/test_linear_step.py tests that call)."""
    decoder = CompiledDecoder(model, model.new_state(rows), one_call=False)
    log = decoder.compile_now(batch)
    assert log.error is None and decoder.compiled, log
    if require_captured:
        assert all(decoder.captured(c) for c in decoder.ready), "steps would keep their guard checks"
    return decoder


# A Llama's block (rotary positions, grouped-query attention, SwiGLU, RMSNorm) compiles to the eager step too, under
# softmax and linearized.
@pytest.mark.parametrize("kind", [*COMPILABLE_KINDS, "softmax+llama", "linear+llama"])
def test_compiled_steps_give_eager_log_probabilities_as_rows_finish_and_join(kind):
    model = shared_tiny_model(kind)  # made outside inference mode, as models are loaded
    with torch.inference_mode():
        _compare_steps_as_rows_finish_and_join(model)


def _compare_steps_as_rows_finish_and_join(model) -> None:
    eager, compiled = EagerDecoder(model, model.new_state(ROWS)), compiled_decoder(model)
    assert set(compiled.log.seconds) == {"1 row", "2 or more rows"}  # two graphs for fewer rows than MANY_ROWS
    # Every step runs its captured graph directly: a call through the guarded function fails the decoder
    # (it would fall back to eager steps, which the comparisons below could not tell apart).
    forbid_guarded_calls(compiled.graphs.steps)
    # live rows per step: all, rows finish, one row alone (the 1-row graph), rows join from reset slots
    _compare_steps(eager, compiled, random_bytes(7, ROWS, 40), [8, 8, 5, 5, 1, 3, 4, 4, 8, 2])


def _compare_steps(eager: EagerDecoder, compiled: CompiledDecoder, tokens: torch.Tensor, schedule: list[int]) -> None:
    """Step both decoders on the first `live` rows of each step's tokens, resetting the rows that join."""
    for step, live in enumerate(schedule):
        if step and live > schedule[step - 1]:
            for decoder in (eager, compiled):
                decoder.state.reset_rows(range(schedule[step - 1], live))
        # The graph a step runs without its guard checks is the one those checks would have chosen.
        assert compiled.step_inputs_accepted(live), f"step {step}: {live} rows fail the captured graph's guards"
        want, got = eager(tokens[:live, step]), compiled(tokens[:live, step])
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"step {step}"
        gap = (torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max().item()
        assert gap < LOGPROB_TOLERANCE, f"step {step}: log-probabilities differ by {gap:.2e}"
    assert torch.equal(compiled.state.lengths, eager.state.lengths)
    assert compiled.compiled and compiled.log.error is None, compiled.log


@pytest.mark.parametrize("kind", kinds_where(lambda c: c.compilable and c.constant_state))
def test_many_rows_run_a_graph_of_their_own_guard_free(kind):
    """A decoder of MANY_ROWS.fewest rows or more of a constant-state kind compiles a third graph, for that many rows or more, traced
    with that count as the row count's size hint; fewer rows keep the 2-row graph, which also serves many rows
    until the third is compiled."""
    many = MANY_ROWS.fewest
    model, rows = make_tiny_model(kind), many + 2
    torch.set_num_threads(2)  # with one thread there is no such class; the autouse fixture sets one back
    with torch.inference_mode():
        eager, compiled = EagerDecoder(model, model.new_state(rows)), compiled_decoder(model, rows, batch=2)
        assert compiled.class_for(rows) == 2 and set(compiled.log.seconds) == {"2 or more rows"}
        _compare_steps(eager, compiled, random_bytes(5, rows, 1), [rows])
        assert compiled.compile_now().error is None
        assert set(compiled.log.seconds) == {"1 row", "2 or more rows", MANY_ROWS.name}
        assert [compiled.class_for(n) for n in (1, 2, many - 1, many, rows)] == [1, 2, 2, many, many]
        assert all(compiled.captured(n) for n in (1, 2, many)), "steps would keep their guard checks"
        forbid_guarded_calls(compiled.graphs.steps)
        forbid_guarded_calls(compiled.graphs.draws)
        _compare_steps(eager, compiled, random_bytes(6, rows, 8), [rows, many, many - 1, 2, 1, many + 1, rows])
        _compare_draws(eager, compiled, rows)
    model.train()  # the graphs were traced in eval mode: a model in training mode steps eagerly
    assert [compiled.class_for(n) for n in (1, 2, rows)] == [None, None, None]


def _compare_draws(eager: EagerDecoder, compiled: CompiledDecoder, rows: int) -> None:
    logits = torch.randn(rows, 256, generator=torch.Generator().manual_seed(2)) * 3
    params = BatchSampling.from_params([SamplingParams(temperature=0.5 + i / 40, seed=i) for i in range(rows)])
    for position in range(5):
        where = torch.full((rows,), position)
        assert torch.equal(compiled.sample(logits, params, where), eager.sample(logits, params, where)), position


def test_a_graph_for_many_rows_that_fails_to_compile_is_left_out(monkeypatch):
    """The many-rows graph is optional: if it cannot be compiled, the 2-row graph serves those rows, compiled
    (rather than every row count falling back to eager steps)."""
    torch.set_num_threads(2)  # the autouse fixture sets one thread back
    model, rows = shared_tiny_model("linear"), MANY_ROWS.fewest + 1
    warm_up = CompiledDecoder._warm_up

    def failing_when_hinted(self, row_class):
        if row_class.hinted:
            raise RuntimeError("an operator inductor cannot trace")
        warm_up(self, row_class)

    monkeypatch.setattr(CompiledDecoder, "_warm_up", failing_when_hinted)
    with torch.inference_mode():
        eager, compiled = EagerDecoder(model, model.new_state(rows)), compiled_decoder(model, rows)
        assert compiled.log.left_out == [MANY_ROWS.name] and compiled.log.error is None
        assert compiled.class_for(rows) == 2 and compiled.captured(rows)
        forbid_guarded_calls(compiled.graphs.steps)
        _compare_steps(eager, compiled, random_bytes(4, rows, 3), [rows, rows, 2])


def test_a_decoder_names_what_its_steps_run_on():
    """/v1/models' `cpu_route`: eager while compiling, then the route of the kernels this decoder loaded."""
    model = shared_tiny_model("linear")
    with torch.inference_mode():
        decoder = make_decoder(model, model.new_state(ROWS), cuda_graphs=False, compiled=True)
        assert decoder.describe_route() == "eager steps (compiling) on PyTorch's operators"
        assert decoder.compile_now().error is None
    kernels = decoder.log.kernels
    if not kernels.ok:
        assert decoder.describe_route() == "compiled steps on PyTorch's operators"
        pytest.skip(f"the C++ kernels did not load here: {kernels.error}")
    if decoder.one_call_steps:  # heads a whole number of this route's vectors (model/decode/compiled/linear_step.py)
        assert decoder.describe_route() == f"{kernels.route}: one-call steps on the packed kernel, draws in C++"
        return
    layers = "the packed kernel" if packed_linear_wins() else "PyTorch's products"
    assert decoder.describe_route() == f"{kernels.route}: compiled steps, linear layers on {layers}"


@pytest.mark.parametrize("kind, threads", [("linear", 1), ("softmax", 2)])
def test_no_graph_for_many_rows_where_it_does_not_pay(kind, threads):
    """With one thread inductor splits no loop: a graph traced for many rows would be the 2-row one again.
    Softmax's attention runs in its own kernel, not in the loops such a graph splits."""
    torch.set_num_threads(threads)  # the autouse fixture sets one thread back
    model, rows = shared_tiny_model(kind), MANY_ROWS.fewest
    decoder = compiled_decoder(model, rows)
    assert set(decoder.log.seconds) == {"1 row", "2 or more rows"} and decoder.class_for(rows) == 2


def _guarded_call_not_expected(*args):
    raise AssertionError("a warmed-up decode step went through dynamo's guard checks")


def forbid_guarded_calls(graphs_per_class: dict) -> None:
    for graphs in graphs_per_class.values():
        graphs._compiled = _guarded_call_not_expected


def test_a_graph_specialised_to_two_rows_is_not_run_guard_free_for_more():
    """With 2 heads, a graph compiled on 2 rows can tie the batch size to the head count (both 2): such a
    graph must not serve 3 or 8 rows without its guards. The steps stay right either way."""
    model = make_tiny_model("linear", n_heads=2)
    with torch.inference_mode():
        eager, compiled = EagerDecoder(model, model.new_state(ROWS)), compiled_decoder(model, require_captured=False)
        tokens = random_bytes(9, ROWS, 4)
        for step, live in enumerate((2, 3, ROWS, 1)):
            if compiled.graphs.steps[2].captured(2) and live >= 2:
                assert compiled.step_inputs_accepted(live), f"{live} rows run guard-free on a graph that refuses them"
            want, got = eager(tokens[:live, step]), compiled(tokens[:live, step])
            gap = (torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max().item()
            assert gap < LOGPROB_TOLERANCE, f"step {step}"
    assert compiled.log.error is None, compiled.log


@pytest.mark.parametrize("kind", COMPILABLE_KINDS)
def test_compiled_bfloat16_steps_are_as_close_to_float32_as_eager_bfloat16(kind):
    """`--dtype bfloat16` on a CPU decodes through the compiled path too: its logits stay within the
    tolerance eager bfloat16 is held to (tests/test_model_devices.py), against eager float32."""
    model = make_tiny_model(kind)
    half = copy.deepcopy(model).to(torch.bfloat16)
    with torch.inference_mode():
        reference, compiled = EagerDecoder(model, model.new_state(ROWS)), compiled_decoder(half)
        tokens = random_bytes(8, ROWS, 40)
        want = torch.stack([reference(tokens[:, step]) for step in range(40)])
        got = torch.stack([compiled(tokens[:, step]) for step in range(40)])
    assert got.dtype == torch.bfloat16
    assert_bfloat16_close(kind, got.float(), want)


@pytest.mark.parametrize("kind", COMPILABLE_KINDS)
def test_compiled_generate_draws_the_eager_tokens(kind):
    model = shared_tiny_model(kind)
    params = [
        SamplingParams(seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=20, seed=4),
        SamplingParams(temperature=1.3, top_p=0.8, seed=5),
    ]
    prompts = random_bytes(2, len(params), 6)
    sampling = BatchSampling.from_params(params)
    assert torch.equal(generate(model, prompts, 60, sampling), generate(model, prompts, 60, sampling, compiled=False))
    one = BatchSampling.from_params(params[:1])
    assert torch.equal(generate(model, prompts[:1], 60, one), generate(model, prompts[:1], 60, one, compiled=False))


@pytest.mark.parametrize("rows", [ROWS, 3, 1])
def test_compiled_draws_are_the_eager_draws_and_skip_the_guards(rows):
    """An unfiltered batch (greedy rows too) draws through the captured graph directly; a filtered one eagerly."""
    model = shared_tiny_model("linear")
    decoder, eager = compiled_decoder(model), EagerDecoder(model, model.new_state(ROWS))
    assert decoder.graphs.draws[1].captured(1) and decoder.graphs.draws[2].captured(2), (
        "draws would keep their guard checks"
    )
    forbid_guarded_calls(decoder.graphs.draws)
    logits = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)) * 3
    temperatures = [0.0 if i % 3 == 2 else 0.5 + i / 4 for i in range(rows)]
    unfiltered = BatchSampling.from_params([SamplingParams(temperature=t, seed=i) for i, t in enumerate(temperatures)])
    filtered = BatchSampling.from_params(
        [SamplingParams(temperature=t, top_k=5, seed=i) for i, t in enumerate(temperatures)]
    )
    with torch.inference_mode():
        for position in range(50):
            where = torch.full((rows,), position)
            for params in (unfiltered, filtered):
                assert torch.equal(decoder.sample(logits, params, where), eager.sample(logits, params, where))
    assert decoder.log.error is None, decoder.log


def test_a_compiled_draw_takes_other_dtypes_and_strides_as_the_eager_draw_does():
    """The guard-free draw graph is captured for one layout: a caller's float64 temperatures, int32 seeds or a
    strided logits view are brought to it first, not run on a graph that assumes it."""
    model = shared_tiny_model("linear")
    decoder, eager = compiled_decoder(model), EagerDecoder(model, model.new_state(ROWS))
    wide = torch.randn(ROWS, 2 * 256, generator=torch.Generator().manual_seed(2)) * 3
    logits = wide[:, ::2]  # (ROWS, 256), stride 2
    plain = BatchSampling.from_params([SamplingParams(temperature=0.9, seed=7 + i) for i in range(ROWS)])
    odd = BatchSampling(plain.temperature.double(), plain.top_k, plain.top_p, plain.seed.int(), filters=False)
    with torch.inference_mode():
        for position in range(20):
            where = torch.full((ROWS,), position, dtype=torch.int32)
            want = eager.sample(logits.contiguous(), plain, where.long())
            assert torch.equal(decoder.sample(logits, odd, where), want), f"position {position}"
    assert decoder.log.error is None, decoder.log


def test_models_of_one_shape_each_decode_with_their_own_weights():
    """Each model's compiled steps run its own decode twin (its weights packed): never another model's."""
    first, second = make_tiny_model("linear", seed=1), make_tiny_model("linear", seed=2)
    tokens = random_bytes(3, ROWS, 1)[:, 0]
    with torch.inference_mode():
        eager = [EagerDecoder(m, m.new_state(ROWS))(tokens) for m in (first, second)]
        compiled = [compiled_decoder(m)(tokens) for m in (first, second)]
    assert (eager[0] - eager[1]).abs().max() > 0.1  # two models that a shared graph would confuse
    for want, got in zip(eager, compiled):
        assert (torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max() < LOGPROB_TOLERANCE


@pytest.mark.skipif(
    not packed_linear_wins(),
    reason="the packed linear kernel is used on the avx512 and avx2 routes only (model/kernels/loader.py)",
)
def test_compiled_steps_run_a_twin_whose_linear_layers_are_packed_and_which_shares_the_rest():
    model = make_tiny_model("linear", seed=4)
    with torch.inference_mode():
        twin = compiled_decoder(model)._stepped_model
    assert twin is not model and twin is decode_twin(model)  # one twin per model, for all its decoders
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(twin.get_submodule(name), PackedLinear) for name in linears)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())  # the model itself is left as it was
    shared = {id(t) for t in (*twin.parameters(), *twin.buffers())}
    packed_away = {f"{name}.weight" for name in linears}  # the twin holds these packed instead
    assert all(
        id(t) in shared for name, t in (*model.named_parameters(), *model.named_buffers()) if name not in packed_away
    )


def test_a_twin_goes_with_its_model():
    twins, model = DecodeTwins(), make_tiny_model("linear")
    twins._per_model[model] = model.head  # any value that does not hold the model: the key's lifetime is tested
    del model
    gc.collect()
    assert len(twins._per_model) == 0


def test_unasked_decoders_stay_eager():
    linear = make_tiny_model("linear")
    assert type(make_decoder(linear, linear.new_state(2), cuda_graphs=False, compiled=False)) is EagerDecoder
    assert type(make_decoder(linear, linear.new_state(2), cuda_graphs=True)) is EagerDecoder  # no GPU here


def test_a_compile_that_fails_is_logged_and_decoding_stays_eager(caplog):
    # A shape no other test compiles (nothing cached) and a C++ compiler that does not exist.
    model = make_tiny_model("linear", n_layers=1, d_model=16)
    decoder = make_decoder(model, model.new_state(2), cuda_graphs=False, compiled=True)
    with (
        torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}),
        caplog.at_level(logging.WARNING, logger="rnnserve.compiled_decode"),
    ):
        log = decoder.compile_now()
    assert log.error is not None and not decoder.compiled and decoder.wait_compiled(0)
    assert "decoding eagerly" in caplog.text
    eager = EagerDecoder(model, model.new_state(2))
    tokens = torch.tensor([3, 4])
    with torch.inference_mode():
        assert torch.equal(decoder(tokens), eager(tokens))  # the same steps, run eagerly


class RecordingGate:
    """A compile gate that notes the priority of each thread that enters it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.niceness: list[int] = []

    def __enter__(self):
        self.niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def test_a_background_compile_takes_its_turn_at_a_lower_priority():
    model = make_tiny_model("linear")
    decoder, gate = make_decoder(model, model.new_state(ROWS), cuda_graphs=False, compiled=True), RecordingGate()
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with gate.lock:  # another model's compile holds the gate
        decoder.compile(background=True, gate=gate)
        decoder.adopt_compiled()  # nothing to adopt yet: the child has not even started
        assert not decoder.wait_compiled(1.0) and not decoder.compiled
    deadline = time.monotonic() + 600
    while not decoder.wait_compiled(0.2) and time.monotonic() < deadline:
        decoder.adopt_compiled()  # what the engine's thread does between steps
    assert decoder.compiled, decoder.log
    assert gate.niceness == [min(19, ours + BACKGROUND_COMPILE_NICENESS)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == ours  # the caller's is left alone
    assert gate.lock.acquire(blocking=False), "the compile gave its turn back"


# ---------------------------------------------------------------- the server's default


def test_server_compiles_in_the_background_and_answers_what_eager_generate_draws(tmp_path):
    """`rnnserve serve` with default flags: eager first, compiled once the background compile is
    logged; its completion is the eager `generate` draw from the same file."""
    path = save_tiny_model(tmp_path, "text-linear", "linear", "text")
    port, log = free_port(), tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")} | {"OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server",
                "serve",
                "--weights",
                str(tmp_path),
                "--port",
                str(port),
                "--max-batch",
                "4",
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log)
        route = _wait_for_compiled(url, log)["cpu_route"]
        body = {"model": "text-linear", "prompt": "abc", "max_tokens": 20, "temperature": 0.9, "seed": 7, "logprobs": 1}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    finally:
        stop_process(process)
    # Its steps are one C++ call where its heads are whole vectors of the route (model/decode/compiled/linear_step.py):
    # then the compile child compiled only the draws, as the engine decided.
    what = "sampling (its steps are one C++ call)" if "one-call steps" in route else "decode step and sampling"
    assert f"compiled the linear {what} for 2 or more rows in" in log.read_text(), log.read_text()[-2000:]
    # What the engine's steps run on since they compiled: its kernels' route, or PyTorch's operators without them.
    assert route.startswith((f"{cpu_route()}: compiled steps", f"{cpu_route()}: one-call steps")) or (
        route == "compiled steps on PyTorch's operators"
    ), route
    model, _ = load_model(path, "cpu")
    want_tokens, want_logprobs = eager_generation(model, list(b"abc"), 20, SamplingParams(temperature=0.9, seed=7))
    assert token_bytes(answer["logprobs"]["tokens"]) == want_tokens
    assert answer["logprobs"]["token_logprobs"] == pytest.approx(want_logprobs, abs=LOGPROB_TOLERANCE)


def _wait_for_compiled(url: str, log: Path, seconds: float = 600) -> dict:
    """The first model's /v1/models entry once it says its steps are compiled."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        entry = httpx.get(f"{url}/v1/models").json()["data"][0]
        if entry["compiled_decode"]:
            return entry
        if "decoding eagerly" in log.read_text():
            pytest.fail(f"the background compile failed:\n{log.read_text()}")
        time.sleep(1)
    pytest.fail(f"not compiled after {seconds:g} s:\n{log.read_text()}")


@pytest.mark.parametrize("engines", ["--engine-process", "--no-engine-process"])
def test_a_server_stopped_while_compiling_exits_cleanly(tmp_path, engines):
    """SIGTERM while the engines still compile: exit 0, and no abort from C++ destructors ("terminate called
    without an active exception", which took the shipped models' server down with status 134 in one stop of two)."""
    save_tiny_model(tmp_path, "text-linear", "linear", "text")
    save_tiny_model(tmp_path, "text-softmax", "softmax", "text")
    port, log = free_port(), tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")} | {
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
    }  # no cached graphs: the compile takes seconds
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server",
                "serve",
                "--weights",
                str(tmp_path),
                "--port",
                str(port),
                "--max-batch",
                "4",
                engines,
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(process, f"http://127.0.0.1:{port}", log)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()
    finally:
        stop_process(process)
    text = log.read_text()
    assert "compiled the softmax decode step" not in text, "the compile ended before the stop: nothing was tested"
    assert "terminate called" not in text and "Traceback" not in text, text


def test_a_process_with_fewer_vector_lanes_builds_its_own_graphs_not_a_wider_process_s(tmp_path):
    """Over one inductor cache, a process capped below the CPU's vector width (ATEN_CPU_CAPABILITY, as
    benchmarks/as_avx2.sh caps one) draws what eager PyTorch draws after an uncapped process compiled the same
    graphs: it must not load their wider loops and build them with narrower vectors."""
    capped = "avx2" if "avx512f" in read_cpu_features().flags else "default"
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"} | {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)
    }
    for capability in (None, capped):
        child_env = env if capability is None else env | {"ATEN_CPU_CAPABILITY": capability}
        done = subprocess.run(
            [sys.executable, str(REPO / "tests" / "compiled_draw_child.py")],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        counts = json.loads(done.stdout.strip().splitlines()[-1])
        assert counts["differing"] == 0, f"ATEN_CPU_CAPABILITY={capability}: {counts}"
