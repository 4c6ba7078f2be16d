"""LoRA adapters behind the server (issue 43): ``--lora-modules`` adapters in ``/v1/models`` with their
parent, a request's ``model`` field picking its adapter (greedy text equal to peft's merged model in
``transformers``), vLLM's runtime ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` behind their
switch, bad adapter directories as 400s naming the problem, and an adapter unloaded while a request
streams with it: that request finishes with it, new ones get a 404, the server keeps serving.
"""

from __future__ import annotations

import json
import shutil

import pytest
from fastapi.testclient import TestClient

from pagedllm.server.app import build_app

MAX_NEW = 8


@pytest.fixture(scope="module")
def served(smollm2_dir, smol_adapters):
    """``(TestClient, adapters)``: SmolLM2 with two adapter slots, ``attn8`` served from the start."""
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(smollm2_dir), enable_lora=True, max_loras=2, max_lora_rank=16,
                                        num_kv_blocks=256)))
    app = build_app(llm, "smollm2", lora_modules=[("attn8", str(smol_adapters["attn8"][0]))])
    with TestClient(app, raise_server_exceptions=False) as client:
        try:
            yield client, smol_adapters
        finally:
            llm.shutdown()


def _complete(client, model: str, prompt: list[int], n: int = MAX_NEW, **extra):
    return client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n,
                                                "temperature": 0, "ignore_eos": True, **extra})


def _reference_text(merged, tokenizer, greedy_ref, prompt: list[int]) -> str:
    ids, _ = greedy_ref.hf_greedy(merged, prompt, MAX_NEW)
    return tokenizer.decode(ids)


def test_models_list_adapters_and_the_model_field_picks_one(served, smollm2_tokenizer, greedy_ref):
    client, adapters = served
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["smollm2", "attn8"]
    assert data[0]["parent"] is None and data[1]["parent"] == "smollm2" and data[1]["root"] == str(adapters["attn8"][0])
    assert client.get("/v1/models/attn8").json()["id"] == "attn8"
    prompt = smollm2_tokenizer.encode("The capital of France is")
    with_adapter = _complete(client, "attn8", prompt).json()["choices"][0]["text"]
    base = _complete(client, "smollm2", prompt).json()["choices"][0]["text"]
    assert with_adapter == _reference_text(adapters["attn8"][1], smollm2_tokenizer, greedy_ref, prompt) != base
    chat = client.post("/v1/chat/completions", json={"model": "attn8", "max_tokens": 4, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "attn8"
    assert _complete(client, "nope", prompt).status_code == 404


def test_runtime_updates_are_off_unless_switched_on(served, monkeypatch):
    client, adapters = served
    monkeypatch.delenv("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "mlp8", "lora_path": str(adapters["mlp8"][0])})
    assert r.status_code == 400 and "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING" in r.json()["error"]["message"]


def test_load_bad_adapters_and_unload_under_a_running_request(served, smollm2_tokenizer, greedy_ref, monkeypatch,
                                                             tmp_path):
    client, adapters = served
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # vLLM's switch is taken too
    copy = tmp_path / "mlp8"
    shutil.copytree(adapters["mlp8"][0], copy)
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "mlp8", "lora_path": str(copy)})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'mlp8' added successfully."
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "mlp8", "lora_path": str(copy)})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    for bad, why in _bad_adapters(tmp_path, adapters["attn8"][0]):
        r = client.post("/v1/load_lora_adapter", json={"lora_name": bad.name, "lora_path": str(bad)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        assert why in r.json()["error"]["message"], r.json()
    extra = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(copy), "inplace": 1})
    assert extra.status_code == 400 and "inplace" in extra.text
    prompt = smollm2_tokenizer.encode("Water boils at")
    want = _reference_text(adapters["mlp8"][1], smollm2_tokenizer, greedy_ref, prompt)
    with client.stream("POST", "/v1/completions", json={"model": "mlp8", "prompt": prompt, "max_tokens": MAX_NEW,
                                                        "temperature": 0, "ignore_eos": True, "stream": True}) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "mlp8"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'mlp8' removed successfully."
        shutil.rmtree(copy)  # gone from disk too: the running request keeps the adapter it holds
        rest = [line for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in [first] + rest)
    assert text == want
    assert _complete(client, "mlp8", prompt).status_code == 404
    missing = client.post("/v1/unload_lora_adapter", json={"lora_name": "mlp8"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"
    assert _complete(client, "attn8", prompt).status_code == 200
    stats = client.get("/stats").json()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def _bad_adapters(root, good):
    """``(directory, what its 400 must say)``: rank above --max-lora-rank, an unknown target module, no
    weights file."""
    out = []
    for name, edit, why in (("rank32", {"r": 32}, "32"), ("embed", {"target_modules": ["embed_tokens"]}, "embed_tokens"),
                            ("noweights", None, "adapter_model.safetensors")):
        d = root / name
        shutil.copytree(good, d)
        if edit is None:
            (d / "adapter_model.safetensors").unlink()
        else:
            cfg = json.loads((d / "adapter_config.json").read_text())
            cfg.update(edit)
            (d / "adapter_config.json").write_text(json.dumps(cfg))
        out.append((d, why))
    return out
