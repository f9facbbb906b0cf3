// A stand-alone caller of the kernels' AOT entries, linked statically with the kernel sources, so a build for
// another instruction set (aarch64 under qemu-aarch64) runs without Python or MindSpore. tests/support/
// kernel_driver.py writes the requests and reads the results; both files are little-endian, fields packed:
//
//   request file   "MSKDREQ1", u32 count, then count records:
//     call         u32 1, u32 len, entry name, u32 nparam, then per param:
//                  u32 len, dtype name, u32 ndim, i64 shape[ndim], u64 nbytes, the bytes
//     threads      u32 2, i32 n                           (mindserve_matmul_set_threads(n))
//   result file    "MSKDRES1", then per record: i32 rc (call: the entry's return code; threads: the thread
//                  count now), u32 nparam (0 for threads), then per param u64 nbytes, the bytes after the call
//
// Every param (inputs and outputs) is written back, so in-place writes (the KV caches) and entries with
// several outputs come back alike. The result file is flushed after each record: a crash (SIGILL on a CPU
// without the variant's instructions) leaves the records before it readable.
//
//   kernel_driver REQUESTS RESULTS
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using Entry = int (*)(int, void **, int *, int64_t **, const char **, void *, void *);

#define MINDSERVE_ENTRY(name) extern "C" int name(int, void **, int *, int64_t **, const char **, void *, void *);
MINDSERVE_ENTRY(MindserveMatMul)
MINDSERVE_ENTRY(MindserveMatMulAdd)
MINDSERVE_ENTRY(MindservePagedAttention)
MINDSERVE_ENTRY(MindserveRMSNorm)
MINDSERVE_ENTRY(MindserveSwiGLU)
MINDSERVE_ENTRY(MindserveQKVRope)
MINDSERVE_ENTRY(MindserveQKVAttention)
MINDSERVE_ENTRY(MindserveNormMatMul)
MINDSERVE_ENTRY(MindserveSwiGLUMatMulAdd)
MINDSERVE_ENTRY(MindserveDecoderLayer)
MINDSERVE_ENTRY(MindserveEmbedRope)
MINDSERVE_ENTRY(MindserveNormHead)
MINDSERVE_ENTRY(MindserveMoE)
MINDSERVE_ENTRY(MindserveMoEDecoderLayer)
MINDSERVE_ENTRY(MindserveGeGLUMatMul)
MINDSERVE_ENTRY(MindserveNormAdd)
MINDSERVE_ENTRY(MindserveGemmaDecoderLayer)
MINDSERVE_ENTRY(MindservePackQWeight)
MINDSERVE_ENTRY(MindserveDequantize)
#undef MINDSERVE_ENTRY
extern "C" int mindserve_matmul_set_threads(int n);

namespace {

struct Named {
  const char *name;
  Entry fn;
};

#define NAMED(name) Named{#name, &name}
constexpr Named kEntries[] = {
    NAMED(MindserveMatMul),       NAMED(MindserveMatMulAdd),       NAMED(MindservePagedAttention),
    NAMED(MindserveRMSNorm),      NAMED(MindserveSwiGLU),          NAMED(MindserveQKVRope),
    NAMED(MindserveQKVAttention), NAMED(MindserveNormMatMul),      NAMED(MindserveSwiGLUMatMulAdd),
    NAMED(MindserveDecoderLayer), NAMED(MindserveEmbedRope),       NAMED(MindserveNormHead),
    NAMED(MindserveMoE),          NAMED(MindserveMoEDecoderLayer),
    NAMED(MindserveGeGLUMatMul),  NAMED(MindserveNormAdd),         NAMED(MindserveGemmaDecoderLayer),
    NAMED(MindservePackQWeight),  NAMED(MindserveDequantize),
};
#undef NAMED

[[noreturn]] void fail(const char *what, const std::string &detail = "") {
  std::fprintf(stderr, "kernel_driver: %s%s%s\n", what, detail.empty() ? "" : ": ", detail.c_str());
  std::exit(2);
}

class Reader {
 public:
  explicit Reader(const char *path) : f_(std::fopen(path, "rb")) {
    if (!f_) fail("cannot open the request file", path);
  }
  ~Reader() { std::fclose(f_); }
  void bytes(void *p, size_t n) {
    if (n && std::fread(p, 1, n, f_) != n) fail("truncated request file");
  }
  template <class T> T get() {
    T v;
    bytes(&v, sizeof v);
    return v;
  }
  std::string str() {
    std::string s(get<uint32_t>(), '\0');
    bytes(s.data(), s.size());
    return s;
  }

 private:
  std::FILE *f_;
};

class Writer {
 public:
  explicit Writer(const char *path) : f_(std::fopen(path, "wb")) {
    if (!f_) fail("cannot open the result file", path);
  }
  ~Writer() { std::fclose(f_); }
  void bytes(const void *p, size_t n) {
    if (n && std::fwrite(p, 1, n, f_) != n) fail("cannot write the result file");
  }
  template <class T> void put(T v) { bytes(&v, sizeof v); }
  void flush() { std::fflush(f_); }

 private:
  std::FILE *f_;
};

// One argument: its bytes in a 64-byte aligned buffer (as MindSpore's allocator gives), dtype and shape.
struct Param {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  void *data = nullptr;
  Param() = default;
  Param(const Param &) = delete;
  Param &operator=(const Param &) = delete;
  ~Param() { std::free(data); }
};

Entry find_entry(const std::string &name) {
  for (const Named &e : kEntries)
    if (name == e.name) return e.fn;
  fail("no such entry", name);
}

void run_call(Reader &in, Writer &out) {
  const Entry fn = find_entry(in.str());
  const uint32_t n = in.get<uint32_t>();
  std::vector<Param> params(n);
  for (Param &p : params) {
    p.dtype = in.str();
    p.shape.resize(in.get<uint32_t>());
    for (int64_t &d : p.shape) d = in.get<int64_t>();
    p.nbytes = in.get<uint64_t>();
    p.data = std::aligned_alloc(64, (p.nbytes + 63) / 64 * 64 + 64);
    if (!p.data) fail("out of memory");
    in.bytes(p.data, p.nbytes);
  }
  std::vector<void *> ptrs(n);
  std::vector<int> ndims(n);
  std::vector<int64_t *> shapes(n);
  std::vector<const char *> dtypes(n);
  for (uint32_t i = 0; i < n; ++i) {
    ptrs[i] = params[i].data;
    ndims[i] = static_cast<int>(params[i].shape.size());
    shapes[i] = params[i].shape.data();
    dtypes[i] = params[i].dtype.c_str();
  }
  const int32_t rc = fn(static_cast<int>(n), ptrs.data(), ndims.data(), shapes.data(), dtypes.data(), nullptr, nullptr);
  out.put(rc);
  out.put(n);
  for (const Param &p : params) {
    out.put(p.nbytes);
    out.bytes(p.data, p.nbytes);
  }
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 3) fail("usage: kernel_driver REQUESTS RESULTS");
  Reader in(argv[1]);
  char magic[8];
  in.bytes(magic, 8);
  if (std::memcmp(magic, "MSKDREQ1", 8) != 0) fail("not a request file", argv[1]);
  Writer out(argv[2]);
  out.bytes("MSKDRES1", 8);
  out.flush();
  const uint32_t count = in.get<uint32_t>();
  for (uint32_t r = 0; r < count; ++r) {
    switch (in.get<uint32_t>()) {
      case 1:
        run_call(in, out);
        break;
      case 2:
        out.put<int32_t>(mindserve_matmul_set_threads(in.get<int32_t>()));
        out.put<uint32_t>(0);
        break;
      default:
        fail("unknown record kind");
    }
    out.flush();
  }
  return 0;
}
