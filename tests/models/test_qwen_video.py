"""Video (issue 42, first part): Qwen2.5-VL and Qwen2-VL read a video as a grid of frame-pair patches
with 3-D rotary positions whose temporal axis steps by the video's time (Qwen2.5-VL's
``second_per_grid_ts``); Qwen3-VL as one placeholder run per frame pair, each after its time as text
(``<0.2 seconds>``, written as transformers' ``Qwen3VLProcessor`` writes it), each run placed as an
image of its own. The tiny random models of ``test_qwen_vl`` (with a ``<|video_pad|>`` token)
through the Transformers backend give ``transformers``' greedy tokens and top-5 logprobs (float32) for
a video, a video beside an image, and a text-only prompt, whole, chunked through the video and
preempted; our video patches (``multimodal_video``: transformers' video processor needs torchvision)
of a still video equal its image processor's patches of the still. With ``--video-pruning-rate``
(EVS) the rows kept are the most changed ones, and the tokens equal a hand-run ``transformers``
forward on those rows at their whole-video positions (Qwen3-VL: a count per frame group, deepstack rows too).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.models.test_qwen_vl import FAMILIES, IMAGE, MAX_NEW, _image

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
VIDEO_FAMILIES = list(FAMILIES)
# Qwen3-VL's video processor (video_preprocessor_config.json): the image processor's patching, pixel
# bounds on all frames together (two 64 x 96 frames: 12,288 pixels)
QWEN3_VIDEO = {"size": {"shortest_edge": 8192, "longest_edge": 32768}, "patch_size": 16, "temporal_patch_size": 2,
               "merge_size": 2, "video_processor_type": "Qwen3VLVideoProcessor"}


@pytest.fixture(scope="module", params=VIDEO_FAMILIES)
def qwen_vl(request, tmp_path_factory, smollm2_dir):
    """The tiny random model of one video family (``test_qwen_vl.qwen_vl``'s)."""
    import json

    from transformers import AutoImageProcessor

    from tests.models import test_qwen_vl
    out = test_qwen_vl.qwen_vl.__wrapped__(request, tmp_path_factory, smollm2_dir)
    if request.param == "qwen3_vl":
        ip = AutoImageProcessor.from_pretrained(out[0])
        (out[0] / "video_preprocessor_config.json").write_text(json.dumps(
            {**QWEN3_VIDEO, "image_mean": list(ip.image_mean), "image_std": list(ip.image_std)}))
    return out


def _video(seed: int, frames: int = 4, size=(56, 84)) -> np.ndarray:
    """``[frames, H, W, 3]`` uint8: a random first frame, each later one a little changed."""
    rng = np.random.default_rng(seed)
    x = [rng.random((*size, 3))]
    for _ in range(frames - 1):
        x.append(np.clip(x[-1] + 0.3 * rng.random((*size, 3)) * (rng.random((*size, 1)) < 0.3), 0, 1))
    return (np.stack(x) * 255).astype("uint8")


def _inputs(qwen_vl, text, images, videos, rate=0.0):
    from pagedllm.multimodal_patches import PATCH_PROCESSOR_TOKENS, PatchTokenProcessor
    family = qwen_vl[1].config.model_type
    proc = PatchTokenProcessor(qwen_vl[0], PATCH_PROCESSOR_TOKENS[family], family)
    out = proc(text=text, images=images, videos=tuple((v, 2.0) for v in videos), video_pruning_rate=rate)
    out = {k: torch.from_numpy(np.asarray(v)) for k, v in out.items()}
    cfg = qwen_vl[1].config
    out["mm_token_type_ids"] = ((out["input_ids"] == cfg.image_token_id).int()
                                + 2 * (out["input_ids"] == cfg.video_token_id).int())
    return out


def _reference(qwen_vl, greedy_ref, text, images, videos):
    inp = _inputs(qwen_vl, text, images, videos)
    keys = ["mm_token_type_ids"] + (["pixel_values", "image_grid_thw"] if images else [])
    keys += ["pixel_values_videos", "video_grid_thw"] if videos else []
    if videos and qwen_vl[1].config.model_type == "qwen2_5_vl":  # Qwen2-VL's temporal step is one patch
        keys.append("second_per_grid_ts")
    return greedy_ref.hf_greedy(qwen_vl[1], inp["input_ids"][0].tolist(), MAX_NEW, **{k: inp[k] for k in keys})


def _request(text, images, videos):
    data = {k: v for k, v in (("image", images), ("video", videos)) if v}
    return {"prompt": text, "multi_modal_data": data} if data else text


def test_still_video_patches_equal_the_image_processors(qwen_vl):
    """A video of one frame twice is cut as the image processor cuts that frame (which repeats an
    image over the temporal patch): same patch order and values, same grid."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from pagedllm.multimodal_video import qwen3_video_settings, qwen_video_patches
    still = _video(3, frames=1)
    ip = AutoImageProcessor.from_pretrained(qwen_vl[0])
    video = qwen3_video_settings(qwen_vl[0]) if qwen_vl[1].config.model_type == "qwen3_vl" else None
    ours, grid = qwen_video_patches(np.concatenate([still, still]), ip, video)
    theirs = ip(images=[Image.fromarray(still[0])], return_tensors="np")
    assert grid == theirs["image_grid_thw"][0].tolist()
    np.testing.assert_allclose(ours, theirs["pixel_values"], atol=1e-5)


PROMPTS = [(f"What happens in {VIDEO}?", [], [_video(0)]),
           (f"Does {IMAGE} appear in {VIDEO}?", [_image(1, (56, 84))], [_video(1, frames=3, size=(84, 56))]),
           ("Tell me about the printing press.", [], [])]


@pytest.mark.parametrize("budget,blocks", [(2048, 64), (4, 11)])
def test_video_gives_transformers_tokens(qwen_vl, greedy_ref, assert_no_leaks, budget, blocks):
    """Whole prompts; then chunks of 4 tokens (inside a video's 12 placeholders; Qwen3-VL's two runs
    of 6 and their timestamps) in 11 blocks of 4 for prompts of 15-38 tokens with their output
    (Qwen3-VL: 14 blocks for 15-49; preemption: the video is encoded again, its positions kept)."""
    if blocks == 11 and qwen_vl[1].config.model_type == "qwen3_vl":
        blocks = 14  # its longest request (41 + 8 tokens) takes 13 blocks
    llm = LLM(str(qwen_vl[0]), num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=budget)
    outs = llm.generate([_request(*p) for p in PROMPTS], GREEDY, use_tqdm=False)
    for (text, images, videos), out in zip(PROMPTS, outs):
        ids, logits = _reference(qwen_vl, greedy_ref, text, images, videos)
        greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, text)
        greedy_ref.assert_logprobs(out.outputs[0], ids, logits, text)
    if blocks < 64:
        assert llm.llm_engine.get_stats().num_preemptions > 0
    core = llm.engine.core
    assert not core.scheduler.encoder.holders and not core.runner.encoder_cache.entries
    assert_no_leaks(llm.engine)


def test_retained_index_keeps_the_first_step_and_the_most_changed_rows():
    from pagedllm.multimodal_video import retained_index, retained_rows
    step = torch.randn(4, 8)
    second = step.clone()
    second[1] = torch.randn(8)  # one row changes, the rest stay
    third = torch.randn(4, 8)  # all change
    rows = torch.cat([step, second, third])
    assert retained_rows([3, 4, 4], 2, 0.5) == 6 and retained_rows([3, 4, 4], 2, 0.9) == 4
    assert retained_rows([3, 4, 4], 2, 0.0) == 12
    kept = retained_index(rows, [3, 4, 4], 9)
    assert kept.tolist() == [0, 1, 2, 3, 5, 8, 9, 10, 11]


def _whole_columns(pruned_ids: list[int], whole_ids: list[int], video: int, kept: list[int]) -> list[int]:
    """For each token of the pruned prompt, its column in the whole one: text one for one; a run of
    placeholders (Qwen3-VL's: a frame group; Qwen2.5-VL's one run: the whole video) takes the whole
    run's columns of its kept rows (``kept``: row indices of the whole video, ascending)."""
    cols, j, row, done = [], 0, 0, 0
    i = 0
    while i < len(pruned_ids):
        if pruned_ids[i] != video:
            cols.append(j)
            i, j = i + 1, j + 1
            continue
        n = 0
        while i + n < len(pruned_ids) and pruned_ids[i + n] == video:
            n += 1
        full = 0
        while j + full < len(whole_ids) and whole_ids[j + full] == video:
            full += 1
        cols += [j + r - row for r in kept[done:done + n]]
        i, j, row, done = i + n, j + full, row + full, done + n
    return cols


def _evs_reference(qwen_vl, text, video, rate):
    """Greedy tokens and logits of ``transformers`` run by hand on a pruned video: the input embeddings
    with the kept rows of the model's own video features over the placeholders (Qwen3-VL: their deepstack
    rows too), at their whole-video M-RoPE positions (``get_rope_index`` on the unpruned prompt),
    generated tokens at ``p + delta``. Qwen3-VL keeps a count per frame group, written in its prompt."""
    from pagedllm.multimodal_video import retained_index
    model, cfg = qwen_vl[1], qwen_vl[1].config
    qwen3 = cfg.model_type == "qwen3_vl"
    pruned, whole = _inputs(qwen_vl, text, [], [video], rate), _inputs(qwen_vl, text, [], [video])
    grid = whole["video_grid_thw"]
    with torch.no_grad():
        out = model.model.get_video_features(pixel_values_videos=whole["pixel_values_videos"], video_grid_thw=grid)
        feats = torch.cat(out.pooler_output)
        p_ids, w_ids = pruned["input_ids"][0].tolist(), whole["input_ids"][0].tolist()
        slots = (pruned["input_ids"][0] == cfg.video_token_id).nonzero()[:, 0]
        runs = [len(r) for r in "".join("v" if t == cfg.video_token_id else " " for t in p_ids).split()]
        kept = retained_index(feats, grid[0].tolist(), len(slots), runs if qwen3 else None)
        extra = {} if qwen3 else {"second_per_grid_ts": whole["second_per_grid_ts"]}
        pos, delta = model.model.get_rope_index(whole["input_ids"], whole["mm_token_type_ids"], video_grid_thw=grid,
                                                **extra)
        pos = pos[:, :, _whole_columns(p_ids, w_ids, cfg.video_token_id, kept.tolist())]
        n_whole = len(w_ids)
        emb = model.get_input_embeddings()(pruned["input_ids"])
        emb[0, slots] = feats[kept]
        deep = [torch.cat(list(d) if isinstance(d, (list, tuple)) else [d])[kept]
                for d in (out.deepstack_features if qwen3 else [])]
        ids, logits = [], []
        for j in range(MAX_NEW):
            if qwen3:
                mask = torch.zeros(1, emb.shape[1], dtype=torch.bool)
                mask[0, slots] = True
                hidden = model.model.language_model(inputs_embeds=emb, position_ids=pos, visual_pos_masks=mask,
                                                    deepstack_visual_embeds=deep).last_hidden_state
                step_logits = model.lm_head(hidden[0, -1]).float()
            else:
                step_logits = model(inputs_embeds=emb, position_ids=pos).logits[0, -1].float()
            ids.append(int(step_logits.argmax()))
            logits.append(step_logits)
            emb = torch.cat([emb, model.get_input_embeddings()(torch.tensor([[ids[-1]]]))], dim=1)
            pos = torch.cat([pos, torch.full((3, 1, 1), n_whole + j) + delta.reshape(1, 1, 1)], dim=2)
    return ids, torch.stack(logits), len(feats) - len(slots)


@pytest.mark.parametrize("budget,rate,frames,pruned", [(2048, 0.5, 6, (9, 2)), (4, 0.5, 6, (9, 2)),
                                                       (2048, 0.75, 12, (27, 5))])
def test_video_pruning_gives_the_hand_run_reference(qwen_vl, greedy_ref, assert_no_leaks, budget, rate, frames,
                                                    pruned):
    """``--video-pruning-rate 0.5`` on a 6-frame video (3 temporal steps of 6 rows): 9 of 18 rows
    kept, the first step whole; whole and in chunks of 4 (a chunk ends between kept rows of one video,
    whose positions come from the encoder step of an earlier step); 0.75 on 12 frames: 9 of 36 kept.
    Qwen3-VL (2 rows per frame group, a count per group in its prompt, at least one each): 4 of 6 kept,
    then 7 of 12. The pruned count is counted."""
    text, video = f"What changes in {VIDEO} over time?", _video(5, frames=frames)
    ids, logits, n_pruned = _evs_reference(qwen_vl, text, video, rate)
    pruned = pruned[qwen_vl[1].config.model_type == "qwen3_vl"]
    assert n_pruned == pruned
    llm = LLM(str(qwen_vl[0]), num_kv_blocks=64, block_size=4, max_num_batched_tokens=budget, video_pruning_rate=rate)
    out = llm.generate([_request(text, [], [video])], GREEDY, use_tqdm=False)[0]
    greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, "pruned video")
    greedy_ref.assert_logprobs(out.outputs[0], ids, logits, "pruned video")
    assert llm.llm_engine.get_stats().num_video_tokens_pruned == pruned
    assert_no_leaks(llm.engine)


def test_qwen3_vl_writes_transformers_timestamps(qwen_vl):
    """Qwen3-VL's video text is transformers' ``Qwen3VLProcessor.replace_video_token``'s (frame pairs
    at their mean time, one decimal; 3 frames: the last repeated, its pair at 1.0 s), put where the
    prompt's whole ``<|vision_start|><|video_pad|><|vision_end|>`` was (Qwen's own processor, vLLM)."""
    if qwen_vl[1].config.model_type != "qwen3_vl":
        pytest.skip("timestamps are Qwen3-VL's")
    from types import SimpleNamespace

    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    from pagedllm.multimodal_patches import PATCH_PROCESSOR_TOKENS, PatchTokenProcessor
    tok = AutoTokenizer.from_pretrained(qwen_vl[0])
    proc = PatchTokenProcessor(qwen_vl[0], PATCH_PROCESSOR_TOKENS["qwen3_vl"], "qwen3_vl")
    stub = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                           vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                           video_token="<|video_pad|>")  # what replace_video_token reads of its processor
    stub._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(stub, *a)
    text = f"Watch {VIDEO} now."
    for frames, fps in ((4, 2.0), (3, 2.0), (7, 0.5)):
        ours = proc(text=text, videos=((_video(4, frames=frames), fps),))
        meta = VideoMetadata(total_num_frames=frames, fps=fps, frames_indices=list(range(frames)))
        theirs = Qwen3VLProcessor.replace_video_token(stub, {"video_grid_thw": torch.from_numpy(ours["video_grid_thw"]),
                                                             "video_metadata": [meta]}, 0)
        assert ours["input_ids"][0].tolist() == tok(text.replace(VIDEO, theirs))["input_ids"], theirs


def _mp4_data_url(frames: np.ndarray, fps: int = 8) -> str:
    """``frames`` encoded as an MPEG-4 file by PyAV, as a base64 data URL."""
    import base64
    import io

    import av
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


def test_a_video_to_an_image_only_model_is_refused(tiny_llava):
    """LLaVA takes images only: a video is refused naming ``multi_modal_data``, and so is the flag."""
    from pagedllm.sampling_params import SamplingParamError
    llm = LLM(str(tiny_llava[0]), num_kv_blocks=16, block_size=4)
    with pytest.raises(SamplingParamError, match="takes no video"):
        llm.generate({"prompt": "USER: what?", "multi_modal_data": {"video": _video(0)}}, use_tqdm=False)
    with pytest.raises(ValueError, match="--video-pruning-rate"):
        LLM(str(tiny_llava[0]), num_kv_blocks=16, block_size=4, video_pruning_rate=0.5)


def test_retained_per_step_spreads_the_count_over_frame_groups():
    """Qwen3-VL's per-group counts: the first group whole, the rest of ``retained_rows`` spread evenly
    (the earlier groups take the remainder), at least one row each; the choice made within each group."""
    from pagedllm.multimodal_video import retained_index, retained_per_step
    assert retained_per_step([3, 4, 4], 2, 0.5) == [4, 1, 1]  # 6 kept of 12
    assert retained_per_step([4, 4, 4], 2, 0.25) == [4, 3, 3, 2]  # 12 of 16
    assert retained_per_step([3, 4, 4], 2, 0.9) == [4, 1, 1]  # at least one each
    assert retained_per_step([2, 4, 4], 2, 0.0) == [4, 4]
    step = torch.randn(4, 8)
    second = step.clone()
    second[2] = torch.randn(8)
    third = second.clone()
    third[0], third[3] = torch.randn(8), torch.randn(8)
    kept = retained_index(torch.cat([step, second, third]), [3, 4, 4], 7, [4, 1, 2])
    assert kept.tolist() == [0, 1, 2, 3, 6, 8, 11]
