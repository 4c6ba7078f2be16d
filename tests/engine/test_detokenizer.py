"""Incremental detokenization and stop strings with the SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"
TEXTS = [
    "Hello, world! It's a plain ASCII sentence.",
    "Café naïve résumé — déjà vu, Ångström, Łódź, São Paulo.",
    "東京は日本の首都です。北京欢迎你！서울은 한국의 수도입니다.",
    "Emoji: 😀👍🏽🎉 and flags 🇫🇷🇯🇵, family 👨‍👩‍👧, snowman ☃ and math ∑ x² ½ ≠ ∞.",
    "Mixed: price 12€ / ¥500 — “quotes” ‘single’ … done\n\tnew line\r\n",
]
PROMPT = "Please write something:"


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def stream(tok, ids, params=None, prompt_ids=None, chunk=1):
    """Feed ``ids`` ``chunk`` tokens at a time; return (detokenizer, deltas, stopped-at step index or None)."""
    params = params or SamplingParams()
    detok = IncrementalDetokenizer(tok, params, prompt_ids if prompt_ids is not None else tok.encode(PROMPT))
    deltas, stopped_at = [], None
    for start in range(0, len(ids), chunk):
        new = ids[start:start + chunk]
        last = start + chunk >= len(ids)
        stop = detok.append(new, finished=last)
        deltas.append(detok.get_delta(finished=last or stop))
        if stop:
            stopped_at = start
            break
    return detok, deltas, stopped_at


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_full_decode(tok, text, chunk):
    ids = tok.encode(text)
    detok, deltas, stopped = stream(tok, ids, chunk=chunk)
    assert stopped is None
    assert "".join(deltas) == tok.decode(ids) == text
    assert detok.output_text == text
    assert not any(FFFD in d for d in deltas)


def test_multibyte_tokens_are_held_until_complete(tok):
    text = "😀👍🏽"
    ids = tok.encode(text)
    assert any(FFFD in tok.decode([i]) for i in ids)  # the emoji really is split mid-character
    _, deltas, _ = stream(tok, ids)
    assert "".join(deltas) == text
    assert "" in deltas  # some steps produced no text: their bytes were held back


def test_incremental_with_prompt_ending_mid_word(tok):
    ids = tok.encode("ragazzi e ragazze, così è la vita")
    for cut in (1, 4, 7):
        prompt, out = ids[:cut], ids[cut:]
        _, deltas, _ = stream(tok, out, prompt_ids=prompt)
        assert "".join(deltas) == tok.decode(out)


def test_truncated_character_at_finish_matches_full_decode(tok):
    ids = tok.encode("ok 😀")
    ids = ids[:-1]  # end inside the emoji's bytes
    _, deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert "".join(deltas).endswith(FFFD)  # flushed at the end, like the full decode


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5, 8])
def test_a_cut_inside_a_repeated_character_in_one_multi_token_step(tok, chunk):
    # a verified speculative step appends several tokens at once; when the output's last token
    # (cut by max_tokens inside a character) has the same id as an earlier token of that step,
    # only the last one may flush its partial bytes (issue 36: "🌱🌱🌱🌱\ufffd🌱\ufffd")
    ids = tok.encode(" love.\n\n🌱🌱🌱🌱🌱🌱")
    for cut in range(4, len(ids) + 1):
        _, deltas, _ = stream(tok, ids[:cut], chunk=chunk)
        assert "".join(deltas) == tok.decode(ids[:cut]), (cut, chunk)


def test_special_tokens_skipped_or_kept(tok):
    hello = tok.encode("Hello there")
    ids = [1] + hello + [2, 5] + tok.encode(" again")  # <|im_start|> ... <|im_end|> <file_sep>
    _, deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "Hello there again"
    _, deltas, _ = stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------- stop strings

def test_stop_string_across_token_boundary(tok):
    text = "The code is alpha-bravo-charlie and then more words follow."
    ids = tok.encode(text)
    stop = "bravo-char"
    # the stop string spans several tokens
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    detok, deltas, stopped_at = stream(tok, ids, SamplingParams(stop=[stop]))
    assert stopped_at is not None and stopped_at < len(ids) - 1
    assert detok.stop_reason == stop
    assert detok.output_text == "The code is alpha-"
    assert "".join(deltas) == "The code is alpha-"


def test_include_stop_str_in_output(tok):
    ids = tok.encode("The code is alpha-bravo-charlie and then more words follow.")
    detok, deltas, _ = stream(tok, ids, SamplingParams(stop=["bravo-char"], include_stop_str_in_output=True))
    assert detok.output_text == "The code is alpha-bravo-char"
    assert "".join(deltas) == detok.output_text


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("one two three four five six")
    detok, _, _ = stream(tok, ids, SamplingParams(stop=["five", "three f", "zzz"]))
    assert detok.stop_reason == "three f" and detok.output_text == "one two "


def test_stop_string_inside_a_single_token(tok):
    ids = tok.encode("I like strawberries a lot")
    detok, deltas, _ = stream(tok, ids, SamplingParams(stop=["raw"]))
    assert detok.output_text == "I like st" and "".join(deltas) == "I like st"


def test_partial_stop_match_held_back_then_released(tok):
    text = "a < b </en and more </end> tail"
    ids = tok.encode(text)
    params = SamplingParams(stop=["</end>"])
    detok = IncrementalDetokenizer(tok, params, tok.encode(PROMPT))
    sent = ""
    held_seen = False
    for k, t in enumerate(ids):
        stop = detok.append([t], finished=False)
        sent += detok.get_delta(finished=stop)
        if stop:
            break
        # never hand out a tail that could still become "</end>"
        full = detok.output_text
        assert full.startswith(sent)
        tail = full[len(sent):]
        assert len(tail) <= len("</end>") - 1
        if tail:
            held_seen = True
            assert "</end>".startswith(tail)
        if full.endswith("</en"):
            assert not sent.endswith("<") and sent.endswith("b ")
    assert held_seen
    assert detok.stop_reason == "</end>"
    assert sent == "a < b </en and more "


def test_partial_match_released_at_finish(tok):
    ids = tok.encode("value </en")
    _, deltas, stopped = stream(tok, ids, SamplingParams(stop=["</end>"]))
    assert stopped is None
    assert "".join(deltas) == "value </en"  # finished: nothing is held back


def test_stop_token_ids_not_in_text(tok):
    ids = tok.encode("Hello world, bye")
    world = ids[1]
    assert tok.decode([world]) == " world"
    _, deltas, _ = stream(tok, ids, SamplingParams(stop_token_ids=[world]))
    assert "".join(deltas) == "Hello, bye"


# ---------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), num_kv_blocks=64)


def _pick_stop(text: str) -> str:
    """A 4-character substring that first occurs in the middle of ``text``."""
    for start in range(len(text) // 3, len(text) - 4):
        s = text[start:start + 4]
        if text.find(s) == start and s.strip() == s and FFFD not in s:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_llm_stop_string_finishes_and_frees(tiny_llm, assert_no_leaks):
    prompt = list(range(300, 320))
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = tiny_llm.generate([prompt], free, use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 40
    stop = _pick_stop(full.text)
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                            use_tqdm=False)[0]
    comp = out.outputs[0]
    assert out.finished and comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == full.text[:full.text.index(stop)]
    assert comp.token_ids == full.token_ids[:len(comp.token_ids)] and len(comp.token_ids) < 40
    assert_no_leaks(tiny_llm.engine)


def test_stop_string_frees_blocks_while_others_run(tiny_llm, assert_no_leaks):
    eng = tiny_llm.engine
    prompt = list(range(300, 320))
    full = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    stop = _pick_stop(full.text)
    eng.add_request("stopper", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    eng.add_request("other", list(range(50, 90)), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    texts = {"stopper": "", "other": ""}
    ids = {"stopper": [], "other": []}
    finished = {}
    while eng.has_unfinished_requests():
        for o in eng.step(delta=True):
            texts[o.request_id] += o.outputs[0].text
            ids[o.request_id] += o.outputs[0].token_ids
            if o.finished:
                finished[o.request_id] = o
                if o.request_id == "stopper":
                    # freed at once, while "other" keeps running
                    assert "stopper" not in eng.scheduler.requests
                    assert eng.kv_cache_manager.get_block_ids("stopper") == []
                    assert "other" in eng.scheduler.requests
                    assert eng.kv_cache_manager.num_free_blocks == eng.num_blocks - len(
                        eng.kv_cache_manager.get_block_ids("other"))
    assert finished["stopper"].outputs[0].finish_reason == "stop"
    assert finished["stopper"].outputs[0].stop_reason == stop
    assert texts["stopper"] == full.text[:full.text.index(stop)]
    assert finished["other"].outputs[0].finish_reason == "length"
    assert len(ids["other"]) == 60
    assert ids["stopper"] == full.token_ids[:len(ids["stopper"])]
    assert_no_leaks(eng)


def test_streamed_deltas_join_to_final_text(tiny_llm, assert_no_leaks):
    eng = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    final = tiny_llm.generate([[7, 8, 9]], params, use_tqdm=False)[0].outputs[0]
    eng.add_request("s", [7, 8, 9], params)
    text, ids = "", []
    while eng.has_unfinished_requests():
        for o in eng.step(delta=True):
            text += o.outputs[0].text
            ids += o.outputs[0].token_ids
    assert ids == final.token_ids and text == final.text
    assert text == eng.tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert_no_leaks(eng)
