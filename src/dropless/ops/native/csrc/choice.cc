// The library's settings and counters, read and set through ctypes by the Python side
// (choice.py): the kernel choice, the GEMMs each kernel ran, and the tiled kernel's vector width,
// contraction chunks and streaming threshold as this build and this machine have them.
#include <cstdint>

#include "kernel.h"
#include "vec.h"

using dropless_native::ChunkRows;
using dropless_native::g_gemm_calls;
using dropless_native::g_kernel;
using dropless_native::kNtNV;
using dropless_native::kNV;
using dropless_native::kVW;
using dropless_native::StreamMinBytes;

// the kernel choice (0 neither forced, else kernel.h's Kernel: 1 the tiled kernel, 2 OpenBLAS,
// 3 MKL), and GEMMs run so far by each kernel
extern "C" void dropless_set_kernel(int choice) { g_kernel.store(choice); }
extern "C" int dropless_kernel() { return g_kernel.load(); }
extern "C" int64_t dropless_gemm_calls(int which) {   // 0 OpenBLAS, 1 the tiled kernel, 2 MKL
  return which >= 0 && which < 3 ? g_gemm_calls[which].load() : -1;
}
// whether MKL's sgemm is open (kernel.cc: dropless_use_mkl)
extern "C" int dropless_mkl_ready() { return dropless_native::MklReady() ? 1 : 0; }

// the calibrated settings (kernel.h: SettingId), 0 each the build's rule; a bad id is ignored
extern "C" void dropless_set_setting(int id, int value) {
  if (id >= 0 && id < dropless_native::kSettingCount) dropless_native::g_settings[id].store(value);
}
extern "C" int dropless_setting(int id) {
  return id >= 0 && id < dropless_native::kSettingCount ? dropless_native::g_settings[id].load()
                                                         : -1;
}

// floats a vector of the tiled kernel (16: an AVX-512 build, where `KernelChoice` may pick it)
extern "C" int dropless_vector_floats() { return kVW; }
// the size above which the grouped GEMM's forward and drhs outputs are streamed (-1: never)
extern "C" int64_t dropless_stream_min_bytes() { return StreamMinBytes(); }
// the tiled kernel's contraction chunk (`ChunkRows`): of the forward's and drhs's tiles
// (`panel` 0), the NT form's (1, its 2-vector pass) and the fused gate and up tiles (2)
extern "C" int64_t dropless_chunk_rows(int panel) {
  return ChunkRows(panel == 0 ? kNV * kVW : panel == 1 ? kNtNV * kVW : 2 * (kNV / 2) * kVW);
}
