"""Audio through the OpenAI chat API (issue 42, second part): the openai SDK sends an ``input_audio``
part (base64 of a 22.05 kHz stereo WAV file) to the tiny random Qwen2-Audio served in process; PyAV
decodes it to 16 kHz mono and the answer is ``transformers``' on that clip (``LLM.chat`` gives the
same); undecodable base64, bytes that are no audio, a URL not allowed and more clips than
``--limit-mm-per-prompt`` are each a 400 naming the field, and the next request is served with
nothing leaked."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import openai
import pytest

from pagedllm import LLM, SamplingParams
from tests.models.test_qwen2_audio import AUDIO, MAX_NEW, clip, qwen2_audio, reference  # noqa: F401  (fixture)


def _wav_b64(samples: np.ndarray, rate: int = 22050) -> str:
    """Base64 of a 16-bit stereo WAV file of ``samples`` (both channels alike)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.repeat(samples[:, None], 2, axis=1) * 32767).astype("<i2").tobytes())
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def audio_server(qwen2_audio, thread_server):
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.server.app import build_app
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(qwen2_audio[0]), num_kv_blocks=64, block_size=4,
                                        limit_mm_per_prompt={"audio": 1})))
    server = None
    try:
        server = thread_server(build_app(llm, "tiny-qwen2-audio"))
        yield server.url, llm
    finally:
        if server is not None:
            server.stop()
        llm.shutdown()


def _content(data: str) -> list[dict]:
    return [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
            {"type": "text", "text": "What do you hear?"}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_openai_sdk_sends_audio_and_gets_transformers_answer(audio_server, qwen2_audio, greedy_ref):
    from pagedllm.media import audio_from_base64
    data = _wav_b64(np.interp(np.arange(22050) / 22050, np.arange(16000) / 16000, clip(1.0, 440)).astype(np.float32))
    messages = [{"role": "user", "content": _content(data)}]
    reply = _client(audio_server[0]).chat.completions.create(
        model="tiny-qwen2-audio", messages=messages, temperature=0, max_tokens=MAX_NEW, extra_body={"ignore_eos": True})
    tok = qwen2_audio[2].tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": f"{AUDIO}\nWhat do you hear?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids, _ = reference(qwen2_audio, greedy_ref, text, [audio_from_base64(data, "clip", 16000)], False)
    assert reply.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    offline = LLM(str(qwen2_audio[0]), num_kv_blocks=64, block_size=4)
    out = offline.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == ids


@pytest.mark.parametrize("content,param", [
    (_content("@@not-base64@@"), "messages[0].content[0].input_audio"),
    (_content(base64.b64encode(b"plain text, no audio").decode()), "messages[0].content[0].input_audio"),
    ([{"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}}], "messages[0].content[0].audio_url"),
    (_content(_wav_b64(clip(0.3, 300))) * 2, "messages"),
])
def test_bad_audio_is_a_400_naming_the_field(audio_server, assert_no_leaks, content, param):
    client = _client(audio_server[0])
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny-qwen2-audio", messages=[{"role": "user", "content": content}],
                                       max_tokens=2)
    assert ei.value.body["param"] == param, ei.value.body
    assert "multi_modal_data" not in ei.value.body["message"]  # the offline API's name, not the chat API's
    ok = client.chat.completions.create(model="tiny-qwen2-audio", max_tokens=2, messages=[
        {"role": "user", "content": _content(_wav_b64(clip(0.4, 500)))}])
    assert ok.choices[0].finish_reason == "length"
    assert_no_leaks(audio_server[1].engine)
