"""Videos through the OpenAI chat API (issue 42, first part): the openai SDK sends a ``video_url``
part (an MPEG-4 file as a base64 data URL) to a tiny random Qwen2.5-VL / Qwen2-VL served in process;
PyAV decodes it, frames are sampled at 2 per second, and the answer is ``transformers``' on those
frames (``LLM.chat`` gives the same); undecodable base64, bytes that are no video, a URL not allowed
and more videos than ``--limit-mm-per-prompt`` are each a 400 naming the field, and the next request
is served with nothing leaked."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from tests.models.test_qwen_video import (MAX_NEW, VIDEO, _mp4_data_url, _reference, _video,  # noqa: F401
                                          qwen_vl)  # qwen_vl: the fixture

@pytest.fixture(scope="module")
def video_server(qwen_vl, thread_server):
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.server.app import build_app
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(qwen_vl[0]), num_kv_blocks=64, block_size=4,
                                        limit_mm_per_prompt={"video": 1})))
    server = None
    try:
        server = thread_server(build_app(llm, "tiny-qwen-vl"))
        yield server.url, llm
    finally:
        if server is not None:
            server.stop()
        llm.shutdown()


def _video_content(url: str) -> list[dict]:
    return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]


def test_openai_sdk_sends_a_video_and_gets_transformers_answer(video_server, qwen_vl, greedy_ref):
    """An 8 fps, 3-second MPEG-4 as a data URL: PyAV decodes it, 2 frames per second are sampled (6),
    and the answer is ``transformers``' on those frames; ``LLM.chat`` gives the same."""
    import openai

    from pagedllm.media import video_from_url
    url = _mp4_data_url(np.repeat(_video(7, frames=4), 6, axis=0))
    frames, fps = video_from_url(url, "video")
    assert frames.shape[0] == 6 and fps == 2.0
    client = openai.OpenAI(base_url=video_server[0] + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": _video_content(url)}]
    reply = client.chat.completions.create(model="tiny-qwen-vl", messages=messages, temperature=0, max_tokens=MAX_NEW,
                                           extra_body={"ignore_eos": True})
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(qwen_vl[0])
    text = tok.apply_chat_template([{"role": "user", "content": f"{VIDEO}\nWhat happens?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids, _ = _reference(qwen_vl, greedy_ref, text, [], [frames])
    assert reply.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    offline = LLM(str(qwen_vl[0]), num_kv_blocks=64, block_size=4)
    out = offline.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == ids


@pytest.mark.parametrize("content,param", [
    (_video_content("data:video/mp4;base64,@@not-base64@@"), "messages[0].content[0].video_url"),
    (_video_content("data:video/mp4;base64,AAAAAAAA"), "messages[0].content[0].video_url"),
    (_video_content("file:///etc/passwd"), "messages[0].content[0].video_url"),
    (_video_content(_mp4_data_url(_video(1))) * 2, "messages"),
])
def test_bad_videos_are_a_400_naming_the_field(video_server, assert_no_leaks, content, param):
    """Undecodable base64, bytes that are no video, a URL not allowed, more videos than
    ``--limit-mm-per-prompt``: each a 400 naming the field; the next request is served, nothing leaks."""
    import openai
    client = openai.OpenAI(base_url=video_server[0] + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny-qwen-vl", messages=[{"role": "user", "content": content}],
                                       max_tokens=2)
    assert ei.value.body["param"] == param, ei.value.body
    assert "multi_modal_data" not in ei.value.body["message"]  # the offline API's name, not the chat API's
    ok = client.chat.completions.create(model="tiny-qwen-vl", max_tokens=2, messages=[
        {"role": "user", "content": _video_content(_mp4_data_url(_video(2)))}])
    assert ok.choices[0].finish_reason == "length"
    assert_no_leaks(video_server[1].engine)

