"""Images through the OpenAI chat API (issue 41, first part): the openai SDK and LangChain send an
``image_url`` part (a base64 data URL) to a tiny random LLaVA served in process and get
``transformers``' greedy answer; the Responses API's ``input_image`` and Anthropic's ``image`` block
give the same, and so does an ``image_embeds`` part with the tower's output (``--enable-mm-embeds``);
``file://`` and http(s) URLs are read as the flags allow; undecodable base64, a decompression bomb, a file
that is no image, a URL the server does not read, a ``detail`` it does not implement and more images
than ``--limit-mm-per-prompt`` allows are each a 400 naming the field, and the next request is
served with nothing leaked."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest


def _data_url(seed: int) -> tuple[str, object]:
    from PIL import Image
    img = Image.fromarray((np.random.default_rng(seed).random((40, 50, 3)) * 255).astype("uint8"))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), img


def _bomb_url(side: int = 20000) -> str:
    """A data URL of a 100-byte PNG whose header claims ``side`` x ``side`` pixels (a decompression bomb)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A directory with ``picture.png`` (image seed 0), served over HTTP on 127.0.0.1: ``(dir, base URL)``."""
    import functools
    import http.server
    import threading
    root = tmp_path_factory.mktemp("media")
    (root / "picture.png").write_bytes(base64.b64decode(_data_url(0)[0].split(",", 1)[1]))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def llava_server(tiny_llava, thread_server, media):
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.server.app import build_app
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(tiny_llava[0]), num_kv_blocks=64, block_size=4,
                                        limit_mm_per_prompt={"image": 1}, allowed_local_media_path=str(media[0]),
                                        allowed_media_domains=["127.0.0.1"], enable_mm_embeds=True)))
    server = None
    try:
        server = thread_server(build_app(llm, "tiny-llava"))
        yield server.url, llm
    finally:
        if server is not None:
            server.stop()
        llm.shutdown()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _content(url: str, text: str = "What is in this picture?") -> list[dict]:
    return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]


def test_openai_sdk_sends_an_image_and_gets_transformers_answer(llava_server, tiny_llava, greedy_ref):
    url, _ = llava_server
    data_url, img = _data_url(0)
    reply = _client(url).chat.completions.create(
        model="tiny-llava", messages=[{"role": "user", "content": _content(data_url)}], temperature=0, max_tokens=8,
        extra_body={"ignore_eos": True})
    _, model, proc = tiny_llava
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": "<image>\nWhat is in this picture?"}],
                                              tokenize=False, add_generation_prompt=True)
    inp = proc(text=text, images=[img], return_tensors="pt", add_special_tokens=False)
    ids, _ = greedy_ref.hf_greedy(model, inp["input_ids"][0].tolist(), 8, pixel_values=inp["pixel_values"])
    assert reply.choices[0].message.content == proc.tokenizer.decode(ids, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == inp["input_ids"].shape[1]  # 16 placeholders counted


@pytest.mark.parametrize("content,param", [
    (_content("data:image/png;base64,@@not-base64@@"), "messages[0].content[1].image_url"),
    (_content("data:image/png;base64," + base64.b64encode(b"plain text, no image").decode()),
     "messages[0].content[1].image_url"),
    (_content("https://example.com/cat.png"), "messages[0].content[1].image_url"),
    (_content(_bomb_url()), "messages[0].content[1].image_url"),
    (_content(_bomb_url(9000)), "messages[0].content[1].image_url"),
    (_content("file:///etc/passwd"), "messages[0].content[1].image_url"),
    ([{"type": "image_url", "image_url": {"url": "data:,", "detail": "high"}}], "messages[0].content[0].image_url.detail"),
    (_content(_data_url(1)[0]) + [{"type": "image_url", "image_url": {"url": _data_url(2)[0]}}], "messages"),
])
def test_bad_images_are_a_400_naming_the_field(llava_server, assert_no_leaks, content, param):
    url, llm = llava_server
    client = _client(url)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny-llava", messages=[{"role": "user", "content": content}],
                                       max_tokens=2)
    assert ei.value.body["param"] == param, ei.value.body
    assert "multi_modal_data" not in ei.value.body["message"]  # the offline API's name, not the chat API's
    ok = client.chat.completions.create(model="tiny-llava", messages=[{"role": "user", "content": _content(
        _data_url(3)[0])}], max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    assert_no_leaks(llm.engine)


def _embeds_b64(tiny_llava, img) -> str:
    """vLLM's ``image_embeds``: base64 of ``torch.save`` of transformers' tower output for ``img``."""
    import torch
    _, model, proc = tiny_llava
    with torch.no_grad():
        feats = model.get_image_features(pixel_values=proc.image_processor([img], return_tensors="pt")["pixel_values"])
    buf = io.BytesIO()
    torch.save(torch.cat(list(getattr(feats, "pooler_output", feats))).reshape(16, -1), buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_image_embeds_part_answers_as_the_image(llava_server, tiny_llava, assert_no_leaks):
    """An ``image_embeds`` part (``--enable-mm-embeds``) with the tower's output for an image gives the
    answer the ``image_url`` part of that image gives; a part that is not a saved tensor is a 400 naming it."""
    url, llm = llava_server
    client = _client(url)
    data_url, img = _data_url(5)
    ask = {"model": "tiny-llava", "temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    by_image = client.chat.completions.create(messages=[{"role": "user", "content": _content(data_url)}], **ask)
    part = {"type": "image_embeds", "image_embeds": _embeds_b64(tiny_llava, img)}
    by_embeds = client.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, part]}], **ask)
    assert by_embeds.choices[0].message.content == by_image.choices[0].message.content
    assert by_embeds.usage.prompt_tokens == by_image.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(messages=[{"role": "user", "content": [
            {"type": "image_embeds", "image_embeds": base64.b64encode(b"not a tensor").decode()}]}], **ask)
    assert ei.value.body["param"] == "messages[0].content[0].image_embeds", ei.value.body
    assert_no_leaks(llm.engine)


def test_anthropic_sdk_sends_an_image_block(llava_server):
    """Anthropic's ``image`` block (base64 source) reaches the model as the chat image part does: the
    same greedy answer as the OpenAI request with the same image and text."""
    import anthropic
    url, _ = llava_server
    data_url, _ = _data_url(0)
    data = data_url.split(",", 1)[1]
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    msg = client.messages.create(model="tiny-llava", max_tokens=8, extra_body={"temperature": 0}, messages=[{
        "role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}])
    chat = _client(url).chat.completions.create(
        model="tiny-llava", messages=[{"role": "user", "content": _content(data_url)}], temperature=0, max_tokens=8)
    assert msg.content[0].text == chat.choices[0].message.content
    counted = client.messages.count_tokens(model="tiny-llava", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}])
    assert counted.input_tokens == chat.usage.prompt_tokens == msg.usage.input_tokens  # the 16 placeholders counted
    with pytest.raises(anthropic.BadRequestError) as ei:
        client.messages.create(model="tiny-llava", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@@"}}]}])
    assert ei.value.body["type"] == "error" and "messages[0].content[0].source" in ei.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as ei:  # a URL the server does not read: named as its source
        client.messages.create(model="tiny-llava", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    assert "messages[0].content[0].source: host 'example.com'" in ei.value.body["error"]["message"]


def test_responses_input_image(llava_server):
    """The Responses API's ``input_image`` part gives the chat API's answer on the same image and text;
    a ``file_id`` image is a 400 naming it."""
    url, _ = llava_server
    data_url, _ = _data_url(0)
    client = _client(url)
    resp = client.responses.create(model="tiny-llava", max_output_tokens=8, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_text", "text": "What is in this picture?"},
                                    {"type": "input_image", "image_url": data_url}]}])
    chat = client.chat.completions.create(
        model="tiny-llava", messages=[{"role": "user", "content": _content(data_url)}], temperature=0, max_tokens=8)
    assert resp.output_text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="tiny-llava", max_output_tokens=2, input=[{
            "role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}])
    assert ei.value.body["param"] == "input[0].content[0].file_id"


def test_file_and_http_urls_as_the_flags_allow(llava_server, media):
    """``file://`` under ``--allowed-local-media-path`` and http(s) of ``--allowed-media-domains`` give
    the data URL's answer; another host, a missing file and a 404 are 400s naming the part."""
    url, _ = llava_server
    root, base = media
    client = _client(url)

    def ask(image_url):
        return client.chat.completions.create(model="tiny-llava", messages=[{"role": "user", "content": _content(
            image_url)}], temperature=0, max_tokens=6).choices[0].message.content
    want = ask(_data_url(0)[0])
    assert ask(f"file://{root}/picture.png") == want
    assert ask(f"{base}/picture.png") == want
    for bad in (base.replace("127.0.0.1", "localhost") + "/picture.png", f"{base}/missing.png",
                f"file://{root}/missing.png", f"file://{root}/../picture.png"):
        with pytest.raises(openai.BadRequestError) as ei:
            ask(bad)
        assert ei.value.body["param"] == "messages[0].content[1].image_url", bad


def test_langchain_sends_an_image(llava_server):
    """LangChain's ChatOpenAI with an image content block gets the chat API's answer."""
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage
    url, _ = llava_server
    data_url, _ = _data_url(0)
    llm = lc.ChatOpenAI(model="tiny-llava", base_url=f"{url}/v1", api_key="unused", temperature=0, max_tokens=8,
                        max_retries=0)
    got = llm.invoke([HumanMessage(content=_content(data_url))]).content
    chat = _client(url).chat.completions.create(
        model="tiny-llava", messages=[{"role": "user", "content": _content(data_url)}], temperature=0, max_tokens=8)
    assert got == chat.choices[0].message.content
