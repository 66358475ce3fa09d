"""llama.cpp as the imported-model benchmarks' peer: the GGUF written from a Hugging Face folder decodes as
Hugging Face does (greedy tokens equal, f32), and the benchmark's tiny run times it beside rnnserve."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import llamacpp_peer

pytestmark = pytest.mark.skipif(
    llamacpp_peer.available() is not None, reason=str(llamacpp_peer.available()) + " (benchmarks/install_peers.sh)"
)

LLAMA = dict(
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=128,
    vocab_size=500,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    initializer_range=0.3,  # wide weights: greedy tokens that vary, so a wrong layout shows
)
GPT2 = {"n_layer": 2, "n_embd": 48, "n_head": 4, "n_positions": 128, "vocab_size": 500, "initializer_range": 0.3}
NEW_TOKENS = 12


def hugging_face_greedy(folder, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def llamacpp_greedy(folder, tmp_path, prompt: list[int], batch: int = 2) -> torch.Tensor:
    gguf_file = llamacpp_peer.write_gguf(folder, tmp_path / "model.gguf", "f32")
    decoder = llamacpp_peer.LlamaCppDecoder(gguf_file, batch, len(prompt) + NEW_TOKENS + 1, threads=1)
    try:
        return decoder.generate(prompt, NEW_TOKENS)
    finally:
        decoder.close()


def prompt_of(folder) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)("The quick brown fox jumps")["input_ids"]


def test_llama_gguf_greedy_tokens_equal_hugging_faces(tmp_path):
    from benchmarks.llama_small import write_llama_folder

    folder = tmp_path / "llama"
    write_llama_folder(folder, LLAMA, torch.float32, seed=3)
    prompt = prompt_of(folder)
    tokens = llamacpp_greedy(folder, tmp_path, prompt)
    expected = hugging_face_greedy(folder, prompt)
    assert len(set(expected)) > 3  # not one token repeated: the comparison can tell layouts apart
    assert tokens[0].tolist() == expected
    assert tokens[1].tolist() == expected  # the second parallel sequence decodes the same


def test_gpt2_gguf_greedy_tokens_equal_hugging_faces(tmp_path):
    from benchmarks.gpt2_small import write_gpt2_folder

    folder = tmp_path / "gpt2"
    write_gpt2_folder(folder, GPT2, seed=3)
    prompt = prompt_of(folder)
    tokens = llamacpp_greedy(folder, tmp_path, prompt)
    expected = hugging_face_greedy(folder, prompt)
    assert len(set(expected)) > 3
    assert tokens[0].tolist() == expected
    assert tokens[1].tolist() == expected


def test_write_gguf_names_what_it_cannot_write(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(ValueError, match="model_type 'mistral'.*'llama' and 'gpt2'"):
        llamacpp_peer.write_gguf(tmp_path, tmp_path / "out.gguf")
    with pytest.raises(ValueError, match="expected one of f32, f16, bf16"):
        llamacpp_peer.write_gguf(tmp_path, tmp_path / "out.gguf", "q4_0")


def test_llamacpp_takes_its_turns_in_the_benchmarks_throughput_run(tmp_path):
    """The peer's contestants join measure_throughput's turns (beside Hugging Face here; rnnserve's compiled
    contestants are left out: compiling them takes minutes) with their own dtype and threads in each row."""
    from benchmarks.gpt2_small import Gpt2Settings, measure_throughput
    from benchmarks.llama_small import write_llama_folder

    folder = tmp_path / "llama"
    write_llama_folder(folder, LLAMA, torch.float32, seed=0)
    files = llamacpp_peer.gguf_files(folder, tmp_path, ("f32", "f16"))
    peers = llamacpp_peer.peer_contestants(files, [llamacpp_peer.start_token(folder)])
    settings = Gpt2Settings(sizes={}, new_tokens=4, rounds=1)
    rows = measure_throughput({}, folder, settings, lambda line: None, peers=peers)
    peer_rows = [r for r in rows if r["contestant"].startswith("llama.cpp")]
    assert {(r["dtype"], r["threads"], r["batch"]) for r in peer_rows} == {
        (dtype, threads, batch) for dtype in ("f32", "f16") for threads in (1, 2) for batch in (1, 16)
    }
    assert all(r["model_dtype"] == "float32" and r["engine"].startswith("llama-cpp-python") for r in peer_rows)
    assert all(r["tokens_per_s"] > 0 and len(r["seconds"]) == 1 for r in peer_rows)


def test_llamacpp_steps_in_the_position_sweep_beside_rnnserve_its_cache_growing_with_position(tmp_path):
    """llama.cpp's contestants join the step-time sweep's turns beside an imported model's own (eager here:
    compiling takes minutes): every row's sequence holds the tokens the sweep put there, and its cache grows with
    position while the linearized twin's state does not."""
    from benchmarks.decode_positions import measure_positions
    from benchmarks.decode_settings import DecodeSettings
    from benchmarks.llama_small import linearized_twin, write_llama_folder
    from model.io.hf_import import import_folder
    from model.io.weights import load_model

    folder = tmp_path / "llama"
    write_llama_folder(folder, LLAMA, torch.float32, seed=0)
    import_folder(folder, tmp_path / "llama.safetensors")
    softmax, _ = load_model(tmp_path / "llama.safetensors")
    files = llamacpp_peer.gguf_files(folder, tmp_path, ("f32",))
    positions, steps, batch = [10, 40, 90], 4, 3
    peers = llamacpp_peer.position_peers(files, batch, positions, steps, threads=(1, 2))
    settings = DecodeSettings(compiled=False, steps_per_position=steps, position_batch=batch)
    try:
        models = {"softmax": softmax, "linear": linearized_twin(softmax)}
        points = measure_positions(models, positions, settings, lambda line: None, peers)
        for peer in peers.values():
            memory = peer.decoder.lib.llama_get_memory(peer.decoder.ctx)
            last = [peer.decoder.lib.llama_memory_seq_pos_max(memory, row) for row in range(batch)]
            assert last == [positions[-1] + steps - 1] * batch  # every row stepped to the same position
    finally:
        for peer in peers.values():
            peer.close()
    assert set(points) == {"softmax", "linear", "llama.cpp (f32 GGUF, 1 thread)", "llama.cpp (f32 GGUF, 2 threads)"}
    for name, rows in points.items():
        assert [p.position for p in rows] == positions and all(p.step_seconds_min > 0 for p in rows), name
    for name in ("softmax", "llama.cpp (f32 GGUF, 1 thread)"):
        sizes = [p.state_bytes_per_sequence for p in points[name]]
        assert sizes[0] < sizes[1] < sizes[2], (name, sizes)  # a KV cache: one more entry per token
    assert len({p.state_bytes_per_sequence for p in points["linear"]}) == 1
