"""Planning resources before and while loading: the memory budget, the compiled shapes, the KV cache format, the
kernel path, the device and threads, the graph cache, the load clock."""
