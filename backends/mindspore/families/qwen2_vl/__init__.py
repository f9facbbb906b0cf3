"""Qwen2-VL and Qwen2.5-VL in MindSpore: the reference processor's image/video preprocessing (NumPy/Pillow,
PyAV for frames), the vision tower, multimodal rotary positions (M-RoPE) and the language model built from
``backends.mindspore.network``'s layers over the same paged KV cache layout, loaded from the HF
safetensors layout with a MindFormers-style predict yaml.

entry.py       the family's registry entry (families/__init__.py lists it)
config.py      the predict yaml (+ config.json) -> VLSpec (text ModelSpec, VisionSpec, ProcessorSpec)
preprocess.py  smart_resize, normalisation, patching, frame sampling, placeholder expansion (NumPy)
video.py       frames of a video file at a sampling fps (PyAV)
positions.py   M-RoPE positions (get_rope_index), vision rotary angles, window / frame attention masks
vision.py      the vision tower cell (patch embed, blocks, patch merger)
text.py        the language model cell, AOT or stock (its layer stack, M-RoPE cos/sin, media rows spliced in)
weights.py     the HF safetensors layout, checked by name and shape
encoder.py     the vision tower's driver (the engine's only one); request.py the prompt with its media
"""
