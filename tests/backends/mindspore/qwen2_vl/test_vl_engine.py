"""Qwen2-VL / Qwen2.5-VL behind the engine (tiny random checkpoints, tests/support/make_tiny_qwen2_vl.py):
the golden greedy ids of HF transformers (tests/golden/qwen2_vl_*.json) through ``Engine.submit`` with media
parts, both architectures, both kernel paths; image and text requests batched; the prefix cache keeping
different images apart and sharing the same image; no graph compiled after warm-up; bad media refused.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from backends.errors import InputRejected
from backends.mindspore.engine.kv_cache import block_hashes
from backends.mindspore.families.qwen2_vl.text import media_inputs
from backends.mindspore.runners import PrefillChunk
from backends.types import MediaInput, RequestParams
from tests.support.make_tiny_qwen2_vl import make_tiny_qwen2_vl
from tests.support.paths import DATA_DIR
from tests.support.vl_requests import golden, golden_request, write_golden_clip
from tests.support.vlm_media import IMAGE_FILES

ARCHS = ("qwen2_vl", "qwen2_5_vl")
PROMPTS = ("one_image", "two_images", "video")
GREEDY = RequestParams(max_new_tokens=16, do_sample=False, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny_vl_engine")
    return {arch: make_tiny_qwen2_vl(root / arch, arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return write_golden_clip(tmp_path_factory.mktemp("clip") / "clip.mp4")


def _config(kernels: str, **overrides):
    from backends.settings import EngineConfig

    base = dict(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=64, block_size=16,
                prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4), kernels=kernels, threads=2)
    return EngineConfig(**{**base, **overrides})


@pytest.fixture(scope="module", params=["stock", "aot"])
def engines(request, model_dirs):
    """Both archs on one kernel path, each with the graph count its warm-up left."""
    from backends.mindspore.engine.engine import Engine

    out = {arch: Engine(d, _config(request.param)).start() for arch, d in model_dirs.items()}
    warm = {arch: (e.compiled_graphs, set(e.runner.compiled), set(e.vision.compiled)) for arch, e in out.items()}
    yield out, warm
    for engine in out.values():
        engine.close()


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _ids(result) -> list[int]:
    return [t.id for t in result.tokens]


def _logprobs(result) -> np.ndarray:
    return np.array([t.logprob for t in result.tokens])


# --- host side (no graphs) ---

def test_block_hashes_mix_each_media_digest_into_its_blocks():
    ids = list(range(100, 164))  # 4 blocks of 16; an item on tokens 20..40 (blocks 1 and 2)
    plain = block_hashes(ids, 16)
    a = block_hashes(ids, 16, media=[(20, 40, b"a" * 32)])
    b = block_hashes(ids, 16, media=[(20, 40, b"b" * 32)])
    assert a[0] == b[0] == plain[0]  # before the item: shared
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # the item's blocks and every block after differ
    assert a == block_hashes(ids, 16, media=[(20, 40, b"a" * 32)])


def test_media_inputs_lay_out_rows_positions_and_deltas():
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    chunks = [PrefillChunk([1, 2, 3], 5, [1], media=(rows, np.array([0, 1, 1], np.float32)),
                           mpos=np.array([[5, 6, 6], [5, 6, 7], [5, 7, 8]])),
              PrefillChunk([9], 40, [2], delta=-7)]
    pos = np.array([[5, 6, 7, 40, 0, 0]], np.int32)
    media, mask, mpos = media_inputs(chunks, [(0, 0), (0, 3)], pos, 2)
    np.testing.assert_array_equal(media[0, :3], rows)
    assert media[0, 3:].sum() == 0 and mask[0, :, 0].tolist() == [0, 1, 1, 0, 0, 0]
    np.testing.assert_array_equal(mpos[:, 0, :3], [[5, 6, 6], [5, 6, 7], [5, 7, 8]])
    assert mpos[:, 0, 3].tolist() == [33, 33, 33] and mpos[:, 0, 4:].tolist() == [[0, 0]] * 3


def test_vision_buckets_and_the_memory_budget(model_dirs):
    """The released yamls compile buckets up to their largest image exactly (5120 patches, no 8192); a
    vision-language model's footprint has the tower's activations, a text model's none."""
    from backends.mindspore.families import load_model
    from backends.mindspore.planning.memory import Footprint, _vision_activations
    from backends.mindspore.families.qwen2_vl.config import activation_bytes, load_vl_spec, vision_buckets
    from tests.support.paths import REPO

    released = load_vl_spec(REPO / "configs" / "models" / "predict_qwen2_vl_7b_instruct.yaml")
    assert vision_buckets(released) == (64, 128, 256, 512, 1024, 2048, 4096, 5120)
    # Qwen2-VL 7B at 5120 patches: 16 heads x 5120^2 float32 scores, twice (scores and probabilities)
    assert activation_bytes(released) >= 2 * 16 * 5120 ** 2 * 4
    tiny = load_vl_spec(model_dirs["qwen2_vl"])
    assert vision_buckets(tiny) == (64, 128, 256)  # max_pixels 56*56*16: 256 patches
    assert Footprint.of(load_model(model_dirs["qwen2_vl"])).activation_bytes == activation_bytes(tiny) > 0
    assert _vision_activations(load_model(REPO / "configs" / "models" / "predict_llama2_7b.yaml")) == 0


def test_videos_are_bounded_before_their_frames_are_decoded(model_dirs, tmp_path):
    """A video whose sampled frames exceed the largest vision bucket is refused from its header; frames fitted
    while decoding give the same patches as full-size frames resized by the preprocessing."""
    from backends.mindspore.families.qwen2_vl.config import load_vl_spec
    from backends.mindspore.families.qwen2_vl.preprocess import MediaError, preprocess_video
    from backends.mindspore.families.qwen2_vl.request import build_prompt
    from backends.mindspore.families.qwen2_vl.video import read_video
    from backends.mindspore.modeldir.tokenizer import Tokenizer
    from tests.support.vlm_media import video_frames, write_mp4

    spec = load_vl_spec(model_dirs["qwen2_vl"])
    tokenizer = Tokenizer.from_model_dir(model_dirs["qwen2_vl"], spec.text.tokenizer)
    long_clip = write_mp4(tmp_path / "long.mp4", np.concatenate([video_frames()] * 4), 4)  # 8 s: 16 frames kept
    part = MediaInput("video", long_clip.read_bytes(), "video/mp4", "long.mp4", 0)
    with pytest.raises(MediaError, match="16 sampled frames of 112x84 make 384 vision patches, more than the "
                                         "largest vision bucket 256"):
        build_prompt("watch", [part], spec, tokenizer.encode, max_patches=256)
    odd = write_mp4(tmp_path / "odd.mp4", video_frames()[:, :70, :100], 4)  # 100x70: resized to 112x56
    full, fitted = read_video(odd, spec.processor), read_video(odd.read_bytes(), spec.processor, fit=True)
    assert full.frames.shape[1:3] == (70, 100) and fitted.frames.shape[1:3] == (56, 112)
    np.testing.assert_array_equal(preprocess_video(full.frames, spec.processor, fps=full.sample_fps).pixel_values,
                                  preprocess_video(fitted.frames, spec.processor, fps=fitted.sample_fps).pixel_values)


def test_frame_pixels_are_bounded():
    from backends.mindspore.families.qwen2_vl.preprocess import MediaError
    from backends.mindspore.families.qwen2_vl.video import MAX_FRAME_PIXELS, _check_pixels

    _check_pixels("ok.mp4", 7680, 4320)
    with pytest.raises(MediaError, match=f"big.mp4: frames of 7681x4320 = 33181920 pixels; a video frame may have "
                                         f"at most {MAX_FRAME_PIXELS}"):
        _check_pixels("big.mp4", 7681, 4320)


def test_golden_requests_rebuild_the_golden_prompts(model_dirs, clip):
    """The engine's prompt construction (text + parts at positions) gives the golden ids and positions."""
    from backends.mindspore.families.qwen2_vl.config import load_vl_spec
    from backends.mindspore.families.qwen2_vl.request import build_prompt
    from backends.mindspore.modeldir.tokenizer import Tokenizer

    for arch, d in model_dirs.items():
        spec = load_vl_spec(d)
        tokenizer = Tokenizer.from_model_dir(d, spec.text.tokenizer)
        for name in PROMPTS:
            req, want = golden_request(arch, name, clip), golden(arch)["prompts"][name]
            assert "<|image_pad|>" not in req.text and "<|video_pad|>" not in req.text
            prompt, items = build_prompt(req.text, req.media(), spec, tokenizer.encode)
            assert list(prompt.ids) == want["input_ids"]
            np.testing.assert_array_equal(prompt.positions, want["position_ids"])
            assert prompt.delta == want["rope_delta"] and len(prompt.spans) == len(items)
            for span in prompt.spans:
                pad = spec.image_token_id if span.kind == "image" else spec.video_token_id
                assert set(prompt.ids[span.start:span.end]) == {pad}


# --- through the engine (slow: compiles graphs) ---

@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", PROMPTS)
def test_engine_gives_the_golden_greedy_ids(arch, name, engines, clip):
    engine = engines[0][arch]
    req = golden_request(arch, name, clip)
    result = engine.submit(req.text, GREEDY, media=req.media()).result(timeout=120)
    assert result.prompt_tokens == len(golden(arch)["prompts"][name]["input_ids"])
    assert _ids(result) == golden(arch)["prompts"][name]["greedy_ids"]


def _log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", PROMPTS)
def test_engine_logprobs_equal_the_golden_logits(arch, name, engines, clip):
    """decoder_input_details: each prompt token's logprob at the golden's prompt positions, and each step's
    token logprob, from HF's logits (log-softmax, float64) within 1e-4."""
    engine, want = engines[0][arch], golden(arch)["prompts"][name]
    req = golden_request(arch, name, clip)
    params = RequestParams(max_new_tokens=16, do_sample=False, decoder_input_details=True)
    result = engine.submit(req.text, params, media=req.media()).result(timeout=120)
    ids, length = want["input_ids"], len(want["input_ids"])
    assert [t.id for t in result.prefill] == ids and _ids(result) == want["greedy_ids"]
    for p, logits in zip(want["prompt_logits"]["positions"], want["prompt_logits"]["values"]):
        expected = _log_softmax(logits)[ids[p + 1] if p + 1 < length else want["greedy_ids"][0]]
        got = result.prefill[p + 1].logprob if p + 1 < length else result.tokens[0].logprob
        assert abs(got - expected) < 1e-4, (p, got, expected)
    for step, logits in zip(want["step_logits"]["steps"], want["step_logits"]["values"]):
        expected = _log_softmax(logits)[want["greedy_ids"][step]]
        assert abs(result.tokens[step].logprob - expected) < 1e-4, (step, result.tokens[step].logprob, expected)


@pytest.mark.slow
def test_image_request_batched_with_text_requests_as_alone(engines, clip):
    engine = engines[0]["qwen2_5_vl"]
    req = golden_request("qwen2_5_vl", "two_images", clip)
    texts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
             "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"]
    image_alone = engine.submit(req.text, GREEDY, media=req.media()).result(timeout=120)
    text_alone = [engine.submit(t, GREEDY).result(timeout=120) for t in texts]
    engine.allocator.prefix_caching = False  # every prompt computed again
    try:  # submitted between two steps: admitted together, prefilled and decoded in the same steps
        handles = engine._between_steps(lambda: [
            engine.submit(texts[0], GREEDY), engine.submit(req.text, GREEDY, media=req.media()),
            engine.submit(texts[1], GREEDY)]).result(timeout=120)
        together = [h.result(timeout=120) for h in handles]
    finally:
        engine.allocator.prefix_caching = True
    for alone, batched in zip([text_alone[0], image_alone, text_alone[1]], together):
        assert _ids(batched) == _ids(alone)
        np.testing.assert_allclose(_logprobs(batched), _logprobs(alone), rtol=0, atol=1e-5)
    assert _ids(together[1]) == golden("qwen2_5_vl")["prompts"]["two_images"]["greedy_ids"]


@pytest.mark.slow
def test_prefix_cache_keeps_different_images_apart_and_shares_the_same_one(engines, clip):
    """Two images of one size (equal pad ids) and the same text: only the blocks before the image are
    shared; the same image again shares every full block but the last token's."""
    engine = engines[0]["qwen2_vl"]
    req = golden_request("qwen2_vl", "one_image", clip)
    original = Image.open(DATA_DIR / IMAGE_FILES["a"]).convert("RGB")
    flipped = original.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    kind, position, _ = req.parts[0]

    def run(image: Image.Image):
        before = engine.scheduler.hit_tokens
        media = (MediaInput(kind, _png(image), "image/png", "test", position),)
        result = engine.submit(req.text, GREEDY, media=media).result(timeout=120)
        return result, engine.scheduler.hit_tokens - before

    part = MediaInput(kind, _png(original), "image/png", "t", position)
    prompt, _ = engine.intake.vision_prompt(req.text, (part,), None)
    span, bs, length = prompt.spans[0], engine.allocator.block_size, len(prompt.ids)
    first, _ = run(original)
    assert _ids(first) == golden("qwen2_vl")["prompts"]["one_image"]["greedy_ids"]
    other, other_hits = run(flipped)
    assert other_hits == span.start // bs * bs  # the system prompt's blocks only
    engine.allocator.prefix_caching = False
    try:
        uncached, _ = run(flipped)  # the flipped image computed from scratch
    finally:
        engine.allocator.prefix_caching = True
    assert _ids(other) == _ids(uncached)
    np.testing.assert_allclose(_logprobs(other), _logprobs(uncached), rtol=0, atol=1e-5)
    again, again_hits = run(original)
    assert again_hits == (length - 1) // bs * bs > span.end
    assert _ids(again) == _ids(first)
    np.testing.assert_allclose(_logprobs(again), _logprobs(first), rtol=0, atol=1e-5)
    flipped_again, hits = run(flipped)  # its own blocks are cached now, and give its own output
    assert hits == (length - 1) // bs * bs and _ids(flipped_again) == _ids(other)


@pytest.mark.slow
def test_bad_media_are_refused_at_submit(engines, clip):
    engine = engines[0]["qwen2_vl"]
    req = golden_request("qwen2_vl", "one_image", clip)
    kind, position, path = req.parts[0]
    with pytest.raises(InputRejected, match="does not take audio parts"):
        engine.submit(req.text, GREEDY, media=(MediaInput("audio", b"RIFF", "audio/wav", "a.wav", 0),))
    with pytest.raises(InputRejected, match="inputs media part 0 .*cannot be read as an image"):
        engine.submit(req.text, GREEDY, media=(MediaInput("image", b"\x89PNG junk", "image/png", "x.png", 0),))
    with pytest.raises(InputRejected, match="more image placeholders than images"):
        engine.submit("look: <|vision_start|><|image_pad|><|vision_end|>", GREEDY)
    with pytest.raises(InputRejected, match="would be cut by truncation"):
        engine.submit(req.text, RequestParams(max_new_tokens=4, truncate=20),
                      media=(MediaInput(kind, path.read_bytes(), "image/png", str(path), position),))
    kept = engine.submit(req.text, RequestParams(max_new_tokens=4, truncate=100, do_sample=False),
                         media=(MediaInput(kind, path.read_bytes(), "image/png", str(path), position),))
    assert kept.result(timeout=120).prompt_tokens == 100  # left truncation through the system prompt only
    assert engine.submit("<|im_start|>user\nhi<|im_end|>\n", GREEDY).result(timeout=120).generated_tokens == 16


@pytest.mark.slow
def test_no_graph_is_compiled_after_warm_up(engines, clip):
    """Runs last in the module for its kernel path: every request above used the warm-up's graphs."""
    out, warm = engines
    for arch, engine in out.items():
        for name in PROMPTS:
            req = golden_request(arch, name, clip)
            engine.submit(req.text, GREEDY, media=req.media()).result(timeout=120)
        count, runner, vision = warm[arch]
        assert engine.compiled_graphs == count == len(runner) + len(vision)
        assert engine.runner.compiled == runner and engine.vision.compiled == vision
        assert vision == {("vision", b) for b in engine.vision.buckets}
        assert engine.info()["compiled_graphs"] == count
