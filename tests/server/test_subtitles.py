"""Pure units of pagedllm.server.subtitles: Whisper timestamp tokens -> segments, SRT / WebVTT text,
verbose_json segments, and long audio cut into 30 s windows at the quietest 100 ms."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.server.subtitles import (Segment, clock, compression_ratio, format_srt, format_vtt, parse_segments,
                                       shift, split_audio, verbose_segments)

TS = 1000   # <|0.00|> in this toy vocabulary; <|t|> is TS + t / 0.02
EOT = 900   # ids from EOT to TS are other special tokens
WORDS = {1: " Hello", 2: " world", 3: " again", 4: "!"}


def t(seconds: float) -> int:
    return TS + int(round(seconds / 0.02))


def decode(ids: list[int]) -> str:
    return "".join(WORDS[i] for i in ids)


def spans(segments):
    return [(round(s.start, 2), round(s.end, 2), s.text, s.tokens) for s in segments]


def test_pairs_of_timestamps_close_and_open_segments():
    ids = [t(0), 1, t(1.2), t(1.2), 2, 4, t(2.4), EOT]
    got = parse_segments(ids, TS, EOT, decode, duration=30.0)
    assert spans(got) == [(0.0, 1.2, " Hello", [1]), (1.2, 2.4, " world!", [2, 4])]


def test_single_timestamps_between_segments_and_open_end():
    # Whisper's single timestamp: <|1.00|> ends one segment and starts the next
    ids = [t(0), 1, t(1.0), 2, t(2.0), 3]  # the last text has no closing timestamp (max_tokens)
    got = parse_segments(ids, TS, EOT, decode, duration=5.5)
    assert spans(got) == [(0.0, 1.0, " Hello", [1]), (1.0, 2.0, " world", [2]), (2.0, 5.5, " again", [3])]


def test_text_without_timestamps_special_tokens_and_logprobs():
    got = parse_segments([1, 950, 2, EOT], TS, EOT, decode, duration=3.0, logprobs=[-0.5, -9.0, -1.5, -0.1])
    assert spans(got) == [(0.0, 3.0, " Hello world", [1, 2])]
    assert got[0].logprobs == [-0.5, -1.5]
    assert parse_segments([t(0), t(1.0), EOT], TS, EOT, decode, 3.0) == []  # timestamps only: no segment


def test_times_stay_ordered_and_inside_the_window():
    # a random model breaks Whisper's rules: a closing time before the start, and past the audio
    got = parse_segments([t(2.0), 1, t(1.0), t(4.0), 2, t(29.0)], TS, EOT, decode, duration=5.0)
    assert spans(got) == [(2.0, 2.0, " Hello", [1]), (4.0, 5.0, " world", [2])]


def test_shift_moves_times_and_sets_seek():
    seg = Segment(0.5, 1.0, [1], " Hello")
    (moved,) = shift([seg], 29.55)
    assert (moved.start, moved.end, moved.seek) == (pytest.approx(30.05), pytest.approx(30.55), 2955)
    assert seg.start == 0.5  # the input is left alone


def test_clock_rounding_and_hours():
    assert clock(0, ",") == "00:00:00,000"
    assert clock(1.2, ",") == "00:00:01,200"
    assert clock(3725.0675, ".") == "01:02:05.068"  # rounded to the millisecond


SEGS = [Segment(0.0, 1.2, [1], " Hello"), Segment(1.2, 62.4, [2, 4], " world!")]


def test_srt_text_exact():
    assert format_srt(SEGS) == ("1\n00:00:00,000 --> 00:00:01,200\nHello\n\n"
                                "2\n00:00:01,200 --> 00:01:02,400\nworld!\n\n")
    assert format_srt([]) == ""


def test_vtt_text_exact():
    assert format_vtt(SEGS) == ("WEBVTT\n\n00:00:00.000 --> 00:00:01.200\nHello\n\n"
                                "00:00:01.200 --> 00:01:02.400\nworld!\n\n")
    assert format_vtt([]) == "WEBVTT\n\n"


def test_verbose_segments_have_openai_fields():
    segs = [Segment(0.0, 1.234, [1, 2], " Hello world", seek=0, logprobs=[-0.25, -0.75]),
            Segment(30.0, 31.0, [3], " again", seek=3000)]
    out = verbose_segments(segs, 0.2)
    assert set(out[0]) == {"id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob",
                           "compression_ratio", "no_speech_prob"}
    assert out[0]["id"] == 0 and out[0]["end"] == 1.23 and out[0]["avg_logprob"] == -0.5
    assert out[1]["id"] == 1 and out[1]["seek"] == 3000 and out[1]["avg_logprob"] == 0.0
    assert out[1]["temperature"] == 0.2 and out[1]["tokens"] == [3]


def test_compression_ratio_flags_repetition():
    assert compression_ratio("") == 0.0
    assert compression_ratio(" the the the the the the the the the the the the the the the") > 2.4
    assert compression_ratio(" The quick brown fox.") < 1.5


def test_short_audio_is_one_window():
    wave = np.ones(16000 * 30, np.float32)
    ((start, chunk),) = split_audio(wave, 16000)
    assert start == 0 and len(chunk) == len(wave)


def test_long_audio_is_cut_at_the_quietest_100_ms_before_each_boundary():
    rate = 1000  # 1 kHz keeps the arrays small: windows of 30 000 samples, a 100-sample quiet window
    wave = np.ones(75 * rate, np.float32)
    wave[29_500:29_600] = 0.0           # silence 0.5 s before the first boundary: cut at its middle
    chunks = split_audio(wave, rate)
    starts = [s for s, _ in chunks]
    assert starts[:2] == [0, 29_550]
    assert all(len(c) <= 30 * rate for _, c in chunks)
    assert sum(len(c) for _, c in chunks) == len(wave)          # no gap, no overlap
    assert all(a + len(c) == b for (a, c), (b, _) in zip(chunks, chunks[1:]))
    # no silence in the second search region: a cut inside the last second before its boundary
    assert 29_550 + 29 * rate <= starts[2] <= 29_550 + 30 * rate
