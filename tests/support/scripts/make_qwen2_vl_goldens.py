"""Goldens for the Qwen2-VL tests, from the reference implementation (HF transformers' own processor and
model classes), run once in a separate environment: torch and transformers are not CI dependencies.

    python3 -m venv /work/venv-hf451
    /work/venv-hf451/bin/pip install torch==2.13.0 transformers==4.51.3 pillow safetensors av
    /work/venv-hf451/bin/python -m tests.support.scripts.make_qwen2_vl_goldens --write

transformers 4.51.3: its Qwen2VLImageProcessor does images and video frames in NumPy/Pillow (the later
video processor needs torchvision, which has no CPU build for this torch), and its get_rope_index is the
original Qwen one (text after a vision block resumes at the block's largest position + 1).

Writes tests/data/qwen2_vl_image_{a,b,c}.png (made by tests/support/vlm_media.py) and
tests/golden/qwen2_vl_preprocess.json (processor output on each image and on the sampled clip:
pixel_values shape, sums, per-patch and per-column sums, strided samples; image_grid_thw) and
tests/golden/qwen2_vl_{qwen2_vl,qwen2_5_vl}.json (per prompt: the chat text, input_ids, M-RoPE
positions, logits at a few prompt positions, 16 greedy ids and the logits of every greedy step).
Without --write it only prints a summary. ``--check`` recomputes the image prompts' logits from the
committed goldens with whatever transformers is installed (run with 5.24.0 in /work/venv-hf: within
1.5e-6 of the 4.51.3 goldens, the rounding of the committed values).
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np

from tests.support.make_tiny_qwen2_vl import make_tiny_qwen2_vl
from tests.support.paths import DATA_DIR, GOLDEN_DIR
from tests.support.vlm_media import IMAGE_FILES, VIDEO_FPS, draw_image, video_frames, write_images

NEW_TOKENS = 16
SAMPLE_STRIDE = 997
SAMPLE_FPS = 2.0
LOGIT_STEPS = (0, 1, 7, 15)  # greedy steps whose full logits are kept (step 0: the prompt's last position)
PROMPTS = {
    "one_image": ({"images": ["a"]}, "Describe the picture."),
    "two_images": ({"images": ["b", "c"]}, "Compare the two images."),
    "video": ({"video": True}, "What happens in the video?"),
}


def sampled_frame_indices(total: int, video_fps: float, fps: float = SAMPLE_FPS, factor: int = 2,
                          min_frames: int = 4, max_frames: int = 768) -> list[int]:
    """qwen-vl-utils' sampling (smart_nframes + linspace): the reference the processor is fed from."""
    lo = math.ceil(min_frames / factor) * factor
    hi = math.floor(min(max_frames, total) / factor) * factor
    n = total / video_fps * fps
    n = math.floor(min(max(n, lo), hi) / factor) * factor
    return [int(i) for i in np.round(np.linspace(0, total - 1, n))]


def _r(values) -> list[float]:
    return [round(float(v), 6) for v in values]


def array_summary(x: np.ndarray) -> dict:
    x64 = np.asarray(x, dtype=np.float64)
    flat = x64.reshape(-1)
    return {
        "shape": list(x.shape),
        "sum": float(flat.sum()),
        "abs_sum": float(np.abs(flat).sum()),
        "row_sums": [float(v) for v in x64.reshape(x.shape[0], -1).sum(axis=1)],
        "col_sums": [float(v) for v in x64.reshape(x.shape[0], -1).sum(axis=0)],
        "samples": {"stride": SAMPLE_STRIDE, "values": [float(v) for v in flat[::SAMPLE_STRIDE]]},
    }


def messages_for(spec: dict, text: str) -> list[dict]:
    parts = [{"type": "image"} for _ in spec.get("images", [])]
    if spec.get("video"):
        parts.append({"type": "video"})
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def processor_inputs(processor, spec: dict, text: str, images: dict, frames: list):
    chat = processor.apply_chat_template(messages_for(spec, text), tokenize=False, add_generation_prompt=True)
    kwargs = {}
    if spec.get("images"):
        kwargs["images"] = [images[k] for k in spec["images"]]
    if spec.get("video"):
        kwargs["videos"] = [frames]
        if type(processor).__name__.startswith("Qwen2_5"):  # Qwen2.5-VL times its video positions by fps
            kwargs["fps"] = SAMPLE_FPS
    return chat, processor(text=[chat], return_tensors="pt", **kwargs)


def preprocess_golden(processor, images: dict, frames: list, indices: list[int]) -> dict:
    out = {"images": {}, "video": {}}
    for key, img in images.items():
        feats = processor.image_processor(images=[img], return_tensors="np")
        out["images"][key] = {"file": IMAGE_FILES[key], "size": list(img.size),
                              "image_grid_thw": feats["image_grid_thw"].tolist(),
                              "pixel_values": array_summary(feats["pixel_values"])}
    feats = processor.image_processor(images=None, videos=[frames], return_tensors="np")
    out["video"] = {"frames": len(video_frames()), "video_fps": VIDEO_FPS, "sample_fps": SAMPLE_FPS,
                    "frame_indices": indices, "video_grid_thw": feats["video_grid_thw"].tolist(),
                    "pixel_values_videos": array_summary(feats["pixel_values_videos"])}
    return out


def model_golden(arch: str, model_dir: Path, images: dict, frames: list) -> dict:
    import torch
    from transformers import AutoProcessor, GenerationConfig
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    cls = Qwen2VLForConditionalGeneration if arch == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    processor = AutoProcessor.from_pretrained(model_dir)
    model = cls.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    image_token, video_token = model.config.image_token_id, model.config.video_token_id
    prompts = {}
    for name, (spec, text) in PROMPTS.items():
        chat, inputs = processor_inputs(processor, spec, text, images, frames)
        ids = inputs["input_ids"]
        with torch.no_grad():
            full = model(**inputs).logits[0].numpy()
            positions, delta = model.get_rope_index(ids, inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
                                                    **({"second_per_grid_ts": inputs["second_per_grid_ts"]}
                                                       if "second_per_grid_ts" in inputs else {}))
            gen = model.generate(**inputs, generation_config=GenerationConfig(
                max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0),
                output_logits=True, return_dict_in_generate=True)
            pixel = inputs.get("pixel_values", inputs.get("pixel_values_videos"))
            grid = inputs.get("image_grid_thw", inputs.get("video_grid_thw"))
            embeds = model.visual(pixel, grid_thw=grid).numpy()
        row = ids[0].tolist()
        media = [i for i, t in enumerate(row) if t in (image_token, video_token)]
        picks = sorted({0, media[0], media[-1] + 1, len(row) - 1})
        greedy = gen.sequences[0, len(row):].tolist()
        assert len(greedy) == NEW_TOKENS, (arch, name, greedy)
        prompts[name] = {
            "chat": chat, "input_ids": row,
            "image_grid_thw": inputs["image_grid_thw"].tolist() if "image_grid_thw" in inputs else None,
            "video_grid_thw": inputs["video_grid_thw"].tolist() if "video_grid_thw" in inputs else None,
            "second_per_grid_ts": ([float(v) for v in inputs["second_per_grid_ts"]]
                                   if "second_per_grid_ts" in inputs else None),
            "position_ids": positions[:, 0].tolist(), "rope_delta": int(delta[0, 0]),
            "vision_embeds": {"shape": list(embeds.shape), "row_sums": _r(embeds.sum(1)),
                              "first_row": _r(embeds[0])},
            "prompt_logits": {"positions": picks, "values": [_r(full[p]) for p in picks]},
            "greedy_ids": greedy,
            "step_logits": {"steps": list(LOGIT_STEPS), "values": [_r(gen.logits[s][0].numpy()) for s in LOGIT_STEPS]},
        }
    return {"arch": arch, "new_tokens": NEW_TOKENS, "prompts": prompts}


def check(tmp: Path) -> None:
    """Recompute the image prompts' logits with the installed transformers (e.g. 5.x, whose video processor
    needs torchvision: images only) from the committed ids, and print the largest difference to the goldens."""
    import torch
    from PIL import Image
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    try:  # transformers 5.x: the Pillow backend; 4.x: the NumPy/Pillow Qwen2VLImageProcessor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Processor
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Processor
    from tests.support.make_tiny_qwen2_vl import MAX_PIXELS, MIN_PIXELS

    image_processor = Processor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    classes = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}
    for arch, cls in classes.items():
        model = cls.from_pretrained(make_tiny_qwen2_vl(tmp / arch, arch=arch), torch_dtype=torch.float32,
                                    attn_implementation="eager").eval()
        golden = json.loads((GOLDEN_DIR / f"qwen2_vl_{arch}.json").read_text(encoding="utf-8"))
        for name, (spec, _) in PROMPTS.items():
            if not spec.get("images"):
                continue
            g = golden["prompts"][name]
            feats = image_processor(images=[Image.open(DATA_DIR / IMAGE_FILES[k]).convert("RGB")
                                            for k in spec["images"]], return_tensors="pt")
            ids = torch.tensor([g["input_ids"]])
            kwargs = {"mm_token_type_ids": (ids == model.config.image_token_id).int()}
            with torch.no_grad():
                try:
                    logits = model(input_ids=ids, pixel_values=feats["pixel_values"],
                                   image_grid_thw=feats["image_grid_thw"], **kwargs).logits[0].numpy()
                except TypeError:  # 4.x has no mm_token_type_ids
                    logits = model(input_ids=ids, pixel_values=feats["pixel_values"],
                                   image_grid_thw=feats["image_grid_thw"]).logits[0].numpy()
            diff = max(float(np.abs(logits[p] - np.asarray(v)).max())
                       for p, v in zip(g["prompt_logits"]["positions"], g["prompt_logits"]["values"]))
            print(f"{arch} {name}: max |logit - golden| {diff:.2e}")


def main(argv: list[str] | None = None) -> None:
    import transformers
    import torch

    parser = argparse.ArgumentParser(description="HF transformers goldens for the Qwen2-VL tests")
    parser.add_argument("--write", action="store_true", help="write tests/data/*.png and tests/golden/*.json")
    parser.add_argument("--check", action="store_true",
                        help="only compare the committed image-prompt goldens with this transformers")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(2)
    print("transformers", transformers.__version__, "torch", torch.__version__)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            check(Path(tmp))
        return
    if args.write:
        write_images(DATA_DIR)
    from PIL import Image

    images = {k: (Image.open(DATA_DIR / name).convert("RGB") if args.write else draw_image(k))
              for k, name in IMAGE_FILES.items()}
    clip = video_frames()
    indices = sampled_frame_indices(len(clip), VIDEO_FPS)
    frames = [Image.fromarray(clip[i]) for i in indices]
    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        goldens = {}
        for arch in ("qwen2_vl", "qwen2_5_vl"):
            model_dir = make_tiny_qwen2_vl(Path(tmp) / arch, arch=arch)
            goldens[arch] = {**versions, **model_golden(arch, model_dir, images, frames)}
        from transformers import AutoProcessor

        pre = {**versions, **preprocess_golden(AutoProcessor.from_pretrained(Path(tmp) / "qwen2_vl"), images,
                                               frames, indices)}
    for arch, g in goldens.items():
        for name, p in g["prompts"].items():
            print(arch, name, "tokens", len(p["input_ids"]), "greedy", p["greedy_ids"])
    if args.write:
        GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
        (GOLDEN_DIR / "qwen2_vl_preprocess.json").write_text(json.dumps(pre) + "\n", encoding="utf-8")
        for arch, g in goldens.items():
            (GOLDEN_DIR / f"qwen2_vl_{arch}.json").write_text(json.dumps(g) + "\n", encoding="utf-8")
        print("wrote", GOLDEN_DIR)


if __name__ == "__main__":
    main()
