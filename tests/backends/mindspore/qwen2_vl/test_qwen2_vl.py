"""Qwen2-VL / Qwen2.5-VL (backends/mindspore/qwen2_vl) against HF transformers' goldens
(tests/support/scripts/make_qwen2_vl_goldens.py, transformers 4.51.3): the processor's output on three images and
a clip decoded from a real mp4, the prompts' ids and M-RoPE positions, and, on tiny random checkpoints,
the vision rows, logits within 1e-4 and the 16 greedy ids of the 1-image, 2-image and video prompts.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

from backends.mindspore.modeldir.yaml_tree import ConfigError
from backends.mindspore.families.qwen2_vl.config import load_vl_spec
from backends.mindspore.families.qwen2_vl.positions import frame_ids, rope_index, segment_mask, window_ids
from backends.mindspore.families.qwen2_vl.preprocess import (MediaError, Patches, expand_media_tokens, preprocess_image,
                                                             preprocess_video, sample_frame_indices, smart_resize)
from backends.mindspore.families.qwen2_vl.video import read_video
from backends.mindspore.modeldir.tokenizer import Tokenizer
from backends.chat_template import render_chat_template
from tests.support.scripts.make_qwen2_vl_goldens import PROMPTS, messages_for
from tests.support.make_tiny_qwen2_vl import make_tiny_qwen2_vl
from tests.support.paths import DATA_DIR, GOLDEN_DIR
from tests.support.vlm_media import IMAGE_FILES, VIDEO_FPS, video_frames, write_mp4, write_video

ARCHS = ("qwen2_vl", "qwen2_5_vl")
LOGIT_TOL = 1e-4


def _golden(name: str) -> dict:
    return json.loads((GOLDEN_DIR / f"qwen2_vl_{name}.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny_vl")
    return {arch: make_tiny_qwen2_vl(root / arch, arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def specs(model_dirs) -> dict:
    return {arch: load_vl_spec(d) for arch, d in model_dirs.items()}


@pytest.fixture(scope="module")
def clip(tmp_path_factory, specs):
    """The golden clip as a real mp4 (lossless H.264), read back and sampled at 2 fps by PyAV."""
    path = write_mp4(tmp_path_factory.mktemp("video") / "clip.mp4", video_frames(), VIDEO_FPS)
    return read_video(path, specs["qwen2_vl"].processor)


def _items(spec, prompt_spec: dict, clip) -> list[Patches]:
    items = [preprocess_image(Image.open(DATA_DIR / IMAGE_FILES[k]), spec.processor)
             for k in prompt_spec.get("images", [])]
    if prompt_spec.get("video"):
        items.append(preprocess_video(clip.frames, spec.processor, fps=clip.sample_fps))
    return items


def _assert_pixels(x: np.ndarray, golden: dict) -> None:
    x64 = x.astype(np.float64)
    assert list(x.shape) == golden["shape"]
    np.testing.assert_allclose(x64.sum(1), golden["row_sums"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(x64.sum(0), golden["col_sums"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(x64.reshape(-1)[::golden["samples"]["stride"]], golden["samples"]["values"],
                               rtol=0, atol=1e-12)
    assert abs(np.abs(x64).sum() - golden["abs_sum"]) < 1e-6


# --- preprocessing (no graphs) ---

@pytest.mark.parametrize("key", sorted(IMAGE_FILES))
def test_image_preprocessing_equals_the_reference_processor(key, specs):
    golden = _golden("preprocess")["images"][key]
    patches = preprocess_image(Image.open(DATA_DIR / golden["file"]), specs["qwen2_vl"].processor)
    assert [list(patches.grid)] == golden["image_grid_thw"]
    _assert_pixels(patches.pixel_values, golden["pixel_values"])


def test_three_images_take_the_three_smart_resize_branches(specs):
    proc = specs["qwen2_vl"].processor
    sizes = {k: Image.open(DATA_DIR / name).size for k, name in IMAGE_FILES.items()}
    areas = {k: w * h for k, (w, h) in sizes.items()}
    assert areas["a"] > proc.max_pixels and areas["c"] < proc.min_pixels
    assert proc.min_pixels <= areas["b"] <= proc.max_pixels
    for w, h in sizes.values():
        rh, rw = smart_resize(h, w, proc.factor, proc.min_pixels, proc.max_pixels)
        assert rh % 28 == rw % 28 == 0 and proc.min_pixels <= rh * rw <= proc.max_pixels


def test_video_from_mp4_is_sampled_and_preprocessed_as_the_reference(clip, specs):
    golden = _golden("preprocess")["video"]
    assert list(clip.indices) == golden["frame_indices"]
    assert clip.video_fps == VIDEO_FPS and clip.sample_fps == golden["sample_fps"]
    np.testing.assert_array_equal(clip.frames, video_frames()[golden["frame_indices"]])  # lossless decode
    patches = preprocess_video(clip.frames, specs["qwen2_vl"].processor, fps=clip.sample_fps)
    assert [list(patches.grid)] == golden["video_grid_thw"]
    _assert_pixels(patches.pixel_values, golden["pixel_values_videos"])
    assert patches.second_per_grid == 1.0  # 2 frames per temporal patch at 2 fps


@pytest.mark.parametrize("container,codec,suffix", [("mp4", "libx264", "mp4"), ("avi", "mpeg4", "avi"),
                                                    ("asf", "wmv2", "wmv")])
def test_video_containers_the_ingress_accepts_are_sampled(container, codec, suffix, specs, tmp_path):
    """mp4/avi/wmv (lossy codecs): the same sampled frames, close to the drawn ones."""
    path = write_video(tmp_path / f"clip.{suffix}", video_frames(), VIDEO_FPS, container, codec)
    clip = read_video(path, specs["qwen2_vl"].processor)
    assert clip.indices == (0, 2, 5, 7) and clip.video_fps == VIDEO_FPS and clip.sample_fps == 2.0
    drawn = video_frames()[list(clip.indices)]
    assert clip.frames.shape == drawn.shape and np.abs(clip.frames.astype(int) - drawn).mean() < 12


def _qwen_vl_utils_nframes(total: int, video_fps: float, fps: float) -> int:
    """qwen-vl-utils' smart_nframes, written out for the test (factor 2, 4..768 frames)."""
    n = min(max(total / video_fps * fps, 4), min(768, total))
    return max(2, math.floor(n / 2) * 2)


@pytest.mark.parametrize("total,video_fps", [(8, 4), (300, 30), (31, 10), (1000, 25), (9, 2)])
def test_frame_sampling_matches_qwen_vl_utils(total, video_fps, specs):
    indices = sample_frame_indices(total, video_fps, specs["qwen2_vl"].processor)
    assert len(indices) == _qwen_vl_utils_nframes(total, video_fps, 2.0)
    assert indices[0] == 0 and indices[-1] == total - 1 and indices == sorted(indices)


def test_fixed_frame_count_sampling(specs):
    import dataclasses

    proc = dataclasses.replace(specs["qwen2_vl"].processor, video_frames=7)  # round(7 / 2) * 2 = 8, as qwen-vl-utils
    assert sample_frame_indices(300, 30, proc) == [int(i) for i in np.round(np.linspace(0, 299, 8))]
    with pytest.raises(MediaError, match="asks for 8 frames of a video that has 4"):
        sample_frame_indices(4, 30, proc)


def test_bad_media_are_clear_errors(specs, tmp_path):
    proc = specs["qwen2_vl"].processor
    with pytest.raises(MediaError, match="aspect ratio"):
        smart_resize(10, 2100, 28, proc.min_pixels, proc.max_pixels)
    with pytest.raises(MediaError, match="at least one frame"):
        preprocess_video([], proc)
    not_video = tmp_path / "notes.mp4"
    not_video.write_bytes(b"this is not a video")
    with pytest.raises(MediaError, match="notes.mp4"):
        read_video(not_video, proc)
    item = preprocess_image(Image.open(DATA_DIR / IMAGE_FILES["c"]), proc)
    with pytest.raises(MediaError, match="more image placeholders"):
        expand_media_tokens([5, 6, 6], [item], 6, 7, 2)
    with pytest.raises(MediaError, match="fewer placeholders"):
        expand_media_tokens([5], [item], 6, 7, 2)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_prompt_ids_and_mrope_positions_equal_the_reference(arch, prompt, model_dirs, specs, clip):
    spec, golden = specs[arch], _golden(arch)["prompts"][prompt]
    tokenizer = Tokenizer.from_model_dir(model_dirs[arch], spec.text.tokenizer)
    prompt_spec, text = PROMPTS[prompt]
    chat = render_chat_template(tokenizer.chat_template, messages_for(prompt_spec, text))
    assert chat == golden["chat"]
    items = _items(spec, prompt_spec, clip)
    ids = expand_media_tokens(tokenizer.encode(chat), items, spec.image_token_id, spec.video_token_id, 2)
    assert ids == golden["input_ids"]
    positions, delta = rope_index(ids, items, spec.image_token_id, spec.video_token_id, 2,
                                  spec.vision.tokens_per_second, timed_video=arch == "qwen2_5_vl")
    np.testing.assert_array_equal(positions, golden["position_ids"])
    assert delta == golden["rope_delta"]


def test_text_only_positions_are_one_dimensional(specs):
    spec = specs["qwen2_5_vl"]
    positions, delta = rope_index([10, 11, 12, 13], [], spec.image_token_id, spec.video_token_id, 2, 2.0, True)
    np.testing.assert_array_equal(positions, np.tile(np.arange(4), (3, 1)))
    assert delta == 0


def _hf_window_groups(grid, merge: int, units: int) -> list[set[int]]:
    """Qwen2.5-VL's get_window_index, written out for the test: merged units padded to whole windows,
    window by window; each window's patches (4 per merged unit) as a set of patch indices."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    index = np.arange(t * h * w).reshape(t, h, w)
    pad_h, pad_w = units - h % units, units - w % units
    padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-100)
    nh, nw = (h + pad_h) // units, (w + pad_w) // units
    windows = padded.reshape(t, nh, units, nw, units).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, -1)
    groups = []
    for units_in in windows:
        units_in = units_in[units_in != -100]
        if len(units_in):
            groups.append({int(u) * merge * merge + k for u in units_in for k in range(merge * merge)})
    return groups


@pytest.mark.parametrize("grid", [(1, 12, 18), (1, 6, 8), (2, 6, 8), (1, 16, 16), (3, 20, 10)])
def test_window_ids_group_patches_as_the_reference_window_index(grid):
    ids = window_ids(grid, 2, 4)
    ours = [set(np.flatnonzero(ids == w).tolist()) for w in np.unique(ids)]
    assert sorted(map(sorted, ours)) == sorted(map(sorted, _hf_window_groups(grid, 2, 4)))
    assert set(np.unique(frame_ids(grid))) == set(range(grid[0]))


@pytest.mark.parametrize("grid", [(1, 12, 18), (2, 6, 8), (3, 20, 10)])
def test_window_layout_gathers_each_window_and_back(grid):
    from backends.mindspore.families.qwen2_vl.positions import window_layout

    segments = window_ids(grid, 2, 4)
    n = int(np.prod(grid))
    windows = 1 << int(segments.max()).bit_length()
    layout = window_layout(segments, n + 8, 64, windows)
    slots = layout.index.reshape(windows, 64)
    real = layout.key_mask[:, 0, 0, :] == 0
    assert (slots[~real] == n + 8).all()  # pad slots read the zero row
    for w in range(windows):
        assert set(slots[w][real[w]].tolist()) == set(np.flatnonzero(segments == w).tolist())
    np.testing.assert_array_equal(layout.index[layout.inverse[:n]], np.arange(n))  # gather, then back


def test_segment_mask_isolates_padding():
    mask = segment_mask(np.array([0, 0, 1]), 5)
    assert mask.shape == (5, 5)
    assert (mask[:2, :2] == 0).all() and (mask[2, 2] == 0) and (mask[0, 2] < -1e8)
    assert (mask[3] < -1e8).sum() == 4 and mask[3, 3] == 0  # a padding row sees itself only


# --- config and weights errors (no graphs) ---

RELEASED = {  # the released checkpoints' config.json values; max_pixels the image processor's class default
    "predict_qwen2_vl_7b_instruct.yaml": {
        "family": "qwen2_vl", "text.hidden_size": 3584, "text.num_layers": 28, "text.num_heads": 28,
        "text.num_kv_heads": 4, "text.head_dim": 128, "text.intermediate_size": 18944, "text.vocab_size": 152064,
        "text.rope_theta": 1e6, "text.tie_word_embeddings": False, "text.max_position_embeddings": 32768,
        "mrope_section": (16, 24, 24), "image_token_id": 151655, "video_token_id": 151656,
        "vision_start_token_id": 151652, "vision.depth": 32, "vision.width": 1280, "vision.num_heads": 16,
        "vision.mlp_hidden": 5120, "vision.hidden_act": "quick_gelu", "vision.out_dim": 3584,
        "vision.window_size": 0, "processor.min_pixels": 3136, "processor.max_pixels": 1003520},
    "predict_qwen2_5_vl_7b_instruct.yaml": {
        "family": "qwen2_5_vl", "text.hidden_size": 3584, "text.num_layers": 28, "text.vocab_size": 152064,
        "text.max_position_embeddings": 128000, "mrope_section": (16, 24, 24), "vision.depth": 32,
        "vision.width": 1280, "vision.mlp_hidden": 3420, "vision.hidden_act": "silu", "vision.out_dim": 3584,
        "vision.window_units": 4, "vision.full_attention_blocks": (7, 15, 23, 31), "vision.tokens_per_second": 2.0,
        "processor.max_pixels": 1003520},
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_shipped_vl_yamls_load(name):
    from tests.support.paths import REPO

    spec = load_vl_spec(REPO / "configs" / "models" / name)

    def field(dotted: str):
        value = spec
        for part in dotted.split("."):
            value = getattr(value, part)
        return value

    want = RELEASED[name]
    assert {k: field(k) for k in want} == want
    assert spec.text.checkpoint.name == "models" and spec.text.checkpoint_format == "safetensors"


def _rewrite_yaml(model_dir, old: str, new: str):
    yaml_path = next(model_dir.glob("*.yaml"))
    text = yaml_path.read_text()
    assert old in text
    yaml_path.write_text(text.replace(old, new))
    return yaml_path


def test_config_errors_name_the_key(tmp_path):
    d = make_tiny_qwen2_vl(tmp_path / "m1", arch="qwen2_5_vl")
    _rewrite_yaml(d, "mrope_section: [2, 3, 3]", "mrope_section: [2, 3, 4]")
    with pytest.raises(ConfigError, match="model.model_config.mrope_section"):
        load_vl_spec(d)
    d = make_tiny_qwen2_vl(tmp_path / "m2", arch="qwen2_vl")
    _rewrite_yaml(d, "type: Qwen2VLForConditionalGeneration", "type: LlamaForCausalLM")
    with pytest.raises(ConfigError, match="model.arch.type"):
        load_vl_spec(d)
    d = make_tiny_qwen2_vl(tmp_path / "m3", arch="qwen2_5_vl")
    _rewrite_yaml(d, "fullatt_block_indexes: [1, 3]", "fullatt_block_indexes: [1, 9]")
    with pytest.raises(ConfigError, match="fullatt_block_indexes"):
        load_vl_spec(d)


def test_released_keys_fall_back_to_config_json(tmp_path):
    """A yaml with no vision_config reads the tower from config.json (HF names)."""
    d = make_tiny_qwen2_vl(tmp_path / "m", arch="qwen2_5_vl")
    yaml_path = next(d.glob("*.yaml"))
    text = yaml_path.read_text()
    head, rest = text.split("  vision_config:\n")
    yaml_path.write_text(head + "processor:" + rest.split("processor:", 1)[1])
    spec = load_vl_spec(d)
    assert spec.vision.full_attention_blocks == (1, 3) and spec.vision.window_units == 4
    assert spec.vision.width == 32 and spec.vision.out_dim == 64


def test_weights_are_checked_by_name_and_shape(tmp_path):
    from safetensors.numpy import load_file, save_file

    from backends.mindspore.families.qwen2_vl.weights import load_vl_weights
    from backends.mindspore.modeldir.weights import WeightsError

    d = make_tiny_qwen2_vl(tmp_path / "m", arch="qwen2_vl")
    spec = load_vl_spec(d)
    assert len(load_vl_weights(spec)) > 0
    weights = load_file(str(d / "model.safetensors"))
    fused = dict(weights)
    del fused["visual.merger.mlp.0.bias"]
    save_file(fused, str(d / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"missing \['visual.merger.mlp.0.bias'\]"):
        load_vl_weights(spec)
    bad = dict(weights)
    bad["visual.blocks.1.attn.qkv.weight"] = np.zeros((4, 4), np.float32)
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(WeightsError, match="visual.blocks.1.attn.qkv.weight has shape"):
        load_vl_weights(spec)
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v for k, v in weights.items()}
    save_file(renamed, str(d / "model.safetensors"))  # the transformers >= 4.52 save layout
    assert set(load_vl_weights(spec)) == set(weights)


# --- the model in MindSpore GRAPH mode (slow: compiles graphs) ---

@pytest.fixture(scope="module", params=["stock", "aot"])
def models(request, model_dirs):
    """Both archs on one kernel path: stock MindSpore ops (SplitRunner's) or the AOT kernels (PackedRunner's)."""
    from tests.support.qwen2_vl_reference import Qwen2VL

    return {arch: Qwen2VL(d, threads=2, kernels=request.param) for arch, d in model_dirs.items()}


@pytest.fixture(scope="module")
def runs(models, clip):
    """Each arch's three golden prompts: (prompt, greedy ids, step logits, prompt hidden rows)."""
    out = {}
    for arch, model in models.items():
        for name, (prompt_spec, text) in PROMPTS.items():
            prompt = model.prompt(model.chat(messages_for(prompt_spec, text)), _items(model.spec, prompt_spec, clip))
            out[arch, name] = (prompt, *model.greedy(prompt, _golden(arch)["new_tokens"]))
    return out


def max_logit_diffs(run, model, golden: dict) -> tuple[float, float]:
    _, _, steps, hidden = run
    prompt_logits = model.prompt_logits(hidden)
    at_prompt = max(float(np.abs(prompt_logits[p] - np.asarray(v)).max())
                    for p, v in zip(golden["prompt_logits"]["positions"], golden["prompt_logits"]["values"]))
    at_steps = max(float(np.abs(steps[s] - np.asarray(v)).max())
                   for s, v in zip(golden["step_logits"]["steps"], golden["step_logits"]["values"]))
    return at_prompt, at_steps


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_logits_and_greedy_ids_equal_hf(arch, prompt, runs, models):
    golden = _golden(arch)["prompts"][prompt]
    run = runs[arch, prompt]
    assert run[0].ids.tolist() == golden["input_ids"]
    at_prompt, at_steps = max_logit_diffs(run, models[arch], golden)
    assert at_prompt < LOGIT_TOL and at_steps < LOGIT_TOL, (at_prompt, at_steps)
    assert run[1] == golden["greedy_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_vision_rows_equal_hf(arch, prompt, runs):
    golden = _golden(arch)["prompts"][prompt]["vision_embeds"]
    prompt_obj = runs[arch, prompt][0]
    rows = prompt_obj.media[prompt_obj.media_mask > 0]
    assert list(rows.shape) == golden["shape"]
    np.testing.assert_allclose(rows[0], golden["first_row"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(rows.sum(1), golden["row_sums"], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_window_attention_matters_for_qwen2_5(models, monkeypatch):
    """The negative control: image A spans 2x3 windows; with the whole frame as one window the rows move."""
    from backends.mindspore.families.qwen2_vl.positions import window_layout

    model = models["qwen2_5_vl"]
    item = preprocess_image(Image.open(DATA_DIR / IMAGE_FILES["a"]), model.spec.processor)
    golden = np.asarray(_golden("qwen2_5_vl")["prompts"]["one_image"]["vision_embeds"]["row_sums"])
    np.testing.assert_allclose(model.encode_media(item).sum(1), golden, rtol=0, atol=1e-4)
    monkeypatch.setattr(model, "window_layout", lambda it, bucket: window_layout(frame_ids(it.grid), bucket, bucket, 1))
    assert np.abs(model.encode_media(item).sum(1) - golden).max() > 1e-2


@pytest.mark.slow
def test_image_and_text_rows_batch_together(models, runs):
    """An image prompt and a text-only prompt prefilled in one call and decoded in one call give each the
    logits it gets alone (the image's rows ride in the same cache, on their own blocks)."""
    from tests.support.qwen2_vl_reference import VLSequence

    model = models["qwen2_5_vl"]
    image_prompt, image_ids, image_steps, _ = runs["qwen2_5_vl", "two_images"]
    text_prompt = model.prompt(model.chat([{"role": "user", "content": "What is the capital of France?"}]))
    assert text_prompt.media_mask.sum() == 0 and text_prompt.delta == 0
    solo_ids, solo_steps, _ = model.greedy(text_prompt, 4, first_block=20)
    seqs = [VLSequence(image_prompt, model.blocks_for(len(image_prompt) + 4, 1)),
            VLSequence(text_prompt, model.blocks_for(len(text_prompt) + 4, 10))]
    last = {}
    while any(s.prefilled < len(s.prompt) for s in seqs):  # a 2-row chunk, then the image prompt's rest
        active = [i for i, s in enumerate(seqs) if s.prefilled < len(s.prompt)]
        rows, _ = model.prefill([seqs[i] for i in active])
        last.update(zip(active, rows))
    logits = [last[0], last[1]]
    for seq, row in zip(seqs, logits):
        seq.generated.append(int(np.argmax(row)))
    np.testing.assert_allclose(logits[0], image_steps[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(logits[1], solo_steps[0], rtol=0, atol=1e-5)
    for step in range(1, 4):
        logits = model.decode(seqs)
        np.testing.assert_allclose(logits[0], image_steps[step], rtol=0, atol=1e-5)
        np.testing.assert_allclose(logits[1], solo_steps[step], rtol=0, atol=1e-5)
        for seq, row in zip(seqs, logits):
            seq.generated.append(int(np.argmax(row)))
    assert seqs[0].generated == image_ids[:4] and seqs[1].generated == solo_ids
