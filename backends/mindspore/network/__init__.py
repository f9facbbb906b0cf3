"""The networks, as strategies chosen once with the runner (``runners/``): the AOT-kernel layers
(``aot_layer.py``) and the stock-op layers (``stock_layer.py``) under the Llama family (``llama.py``) and the
Qwen2-VL language model (``families/qwen2_vl/text.py``); shared pieces in ``common.py``. No network class stores a
flag that its methods ask again: adapter slots are a layer class (AOT) or a delta cell (stock ops)."""
