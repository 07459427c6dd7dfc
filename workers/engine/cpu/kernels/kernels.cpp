// The kernels as one translation unit. Each source alone parses the same ~250k lines of ATen
// headers (about 10 s of the build per file on a 2-core machine); included here, they parse them
// once, while bindings.cpp (pybind11 and torch's Python headers) compiles beside them.
#include "paged_decode.cpp"
#include "paged_prefill.cpp"
#include "rms_norm.cpp"
#include "rope_write.cpp"
#include "silu_mul.cpp"
#include "qlinear.cpp"
#include "amx_linear.cpp"
#include "decode_layers.cpp"
