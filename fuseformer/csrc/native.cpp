// Native autograd nodes for fuseformer's eager ops (built on first use by fuseformer/runtime/native.py).
//
// Why: a small eager call (rms_norm over 4096x1024, a ~5 us kernel each way) is host-bound, and the
// host time of a Python autograd.Function's backward is spent on autograd's device thread, which is
// woken once per backward and ran our Python ~2.4x slower than the main thread (H200 host, run 69).
// Here both directions of such an op are a C++ autograd node that launches the kernels Triton has
// already compiled, through the driver's cuLaunchKernel: no Python in the backward at all, and none in
// the forward after the op's own argument checks.
//
// What a node runs is a *plan*, built once in Python per shape/dtype/stream key (ops/rms_norm.py,
// runtime/native.py): a forward program and a backward program. A program allocates its output tensors
// and runs launches; each launch is a compiled kernel (CUfunction, grid, block, shared memory) and its
// runtime arguments in Triton 3.6's order, each either a pointer to a tensor "slot" or a constant.
//   forward slots:  the node's 3 tensor inputs (undefined where None), the plan's held tensors, then the
//                   forward program's outputs;
//   backward slots: the gradients of the node's outputs, the tensors the forward saved, the held tensors,
//                   then the backward program's outputs.
// Anything a plan does not cover (a CUDA graph being captured on the stream, a gradient of an unexpected
// dtype or shape) goes to the op's Python backward, registered as the plan's fallback.
//
// No CUDA headers: the few driver entry points are looked up in libcuda.so.1 at run time, and tests
// on a CPU substitute a fake launch function (set_driver_for_testing) to check what would be launched.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace fuseformer_native {

// CUresult cuLaunchKernel(CUfunction, gridX, gridY, gridZ, blockX, blockY, blockZ, sharedMemBytes,
//                         CUstream, void** kernelParams, void** extra)
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);
// CUresult cuStreamIsCapturing(CUstream, CUstreamCaptureStatus*)
using IsCapturingFn = int (*)(void*, int*);
// CUresult cuGetErrorString(CUresult, const char**)
using ErrorStringFn = int (*)(int, const char**);
// CUresult cuCtxGetCurrent(CUcontext*)
using CtxGetCurrentFn = int (*)(void**);

struct Driver {
  LaunchFn launch = nullptr;
  IsCapturingFn is_capturing = nullptr;
  ErrorStringFn error_string = nullptr;
  CtxGetCurrentFn ctx_get_current = nullptr;
};
Driver g_driver;

bool load_driver() {
  if (g_driver.launch != nullptr) return true;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return false;
  auto launch = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
  auto is_capturing = reinterpret_cast<IsCapturingFn>(dlsym(lib, "cuStreamIsCapturing"));
  if (launch == nullptr || is_capturing == nullptr) return false;
  g_driver.error_string = reinterpret_cast<ErrorStringFn>(dlsym(lib, "cuGetErrorString"));
  g_driver.ctx_get_current = reinterpret_cast<CtxGetCurrentFn>(dlsym(lib, "cuCtxGetCurrent"));
  g_driver.is_capturing = is_capturing;
  g_driver.launch = launch;
  return true;
}

// Tests: a fake cuLaunchKernel / cuStreamIsCapturing (ctypes callbacks), or 0 to forget them.
void set_driver_for_testing(uint64_t launch, uint64_t is_capturing) {
  g_driver.launch = reinterpret_cast<LaunchFn>(launch);
  g_driver.is_capturing = reinterpret_cast<IsCapturingFn>(is_capturing);
  g_driver.error_string = nullptr;
  g_driver.ctx_get_current = nullptr;
}

enum Kind : int64_t { kPointer = 0, kInt32 = 1, kInt64 = 2, kFloat32 = 3 };

struct Arg {
  int64_t kind;
  int64_t value;  // kPointer: the slot; kInt32 / kInt64: the value
  double real;    // kFloat32: the value
};

constexpr size_t kMaxArgs = 30;  // runtime arguments of one launch (Triton appends two scratch pointers)

struct Launch {
  uint64_t function;  // CUfunction
  std::array<unsigned, 3> grid;
  unsigned block;   // threads: 32 x num_warps
  unsigned shared;  // dynamic shared memory bytes
  std::vector<Arg> args;
};

struct Output {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
};

struct Program {
  std::vector<Output> outputs;
  std::vector<Launch> launches;
};

struct Plan {
  Program forward, backward;
  std::vector<at::Tensor> held;           // tensors every launch of the plan may use (e.g. a workspace)
  std::vector<int64_t> saved;             // forward slots saved for the backward
  std::vector<int64_t> returned;          // forward slots the node returns
  std::vector<int64_t> grads;             // per tensor input (3): the backward slot of its gradient, or -1
  std::vector<at::ScalarType> grad_dtypes;  // per returned output: its gradient's dtype
  int64_t fallback = -1;                  // index into g_fallbacks
  uint64_t stream = 0;                    // CUstream of the forward (the backward runs on it too)
  at::Device device = at::Device(at::kCPU);
  std::atomic<int64_t> launches{0};       // launches run by this plan (tests)
  std::atomic<int64_t> fallbacks{0};      // backward calls handed to the fallback (tests)
};

// Plans and fallbacks are never freed: a node holds its plan by address, and a graph may outlive any
// Python-side cache. Python bounds how many plans it makes.
std::vector<std::unique_ptr<Plan>> g_plans;
std::vector<py::object*> g_fallbacks;

[[noreturn]] void launch_failed(int rc) {
  const char* text = nullptr;
  if (g_driver.error_string != nullptr) g_driver.error_string(rc, &text);
  throw std::runtime_error(std::string("fuseformer native launch: cuLaunchKernel failed with CUresult ") +
                           std::to_string(rc) + (text != nullptr ? std::string(" (") + text + ")" : ""));
}

void run(Plan& plan, const Program& program, std::vector<at::Tensor>& slots) {
  if (g_driver.launch == nullptr && !program.launches.empty()) {
    throw std::runtime_error("fuseformer native: no CUDA driver loaded (load_driver() was not called or failed)");
  }
  const auto options = at::TensorOptions().device(plan.device);
  for (const auto& out : program.outputs) slots.push_back(at::empty(out.sizes, options.dtype(out.dtype)));
  void* stream = reinterpret_cast<void*>(plan.stream);
  for (const auto& launch : program.launches) {
    std::array<uint64_t, kMaxArgs + 2> values{};
    std::array<void*, kMaxArgs + 2> params{};
    const size_t n = launch.args.size();
    for (size_t i = 0; i < n; ++i) {
      const Arg& arg = launch.args[i];
      switch (arg.kind) {
        case kPointer:
          values[i] = reinterpret_cast<uint64_t>(slots[arg.value].data_ptr());
          break;
        case kInt32: {
          const int32_t v = static_cast<int32_t>(arg.value);
          std::memcpy(&values[i], &v, sizeof(v));
          break;
        }
        case kInt64:
          std::memcpy(&values[i], &arg.value, sizeof(arg.value));
          break;
        default: {
          const float v = static_cast<float>(arg.real);
          std::memcpy(&values[i], &v, sizeof(v));
        }
      }
      params[i] = &values[i];
    }
    // Triton 3.6's kernels take two more pointers: global and profile scratch (unused: plans are only
    // built for kernels that need neither).
    params[n] = &values[n];
    params[n + 1] = &values[n + 1];
    const int rc = g_driver.launch(reinterpret_cast<void*>(launch.function), launch.grid[0], launch.grid[1],
                                   launch.grid[2], launch.block, 1, 1, launch.shared, stream, params.data(),
                                   nullptr);
    if (rc != 0) launch_failed(rc);
    ++plan.launches;
  }
}

struct NativeFunction : public torch::autograd::Function<NativeFunction> {
  static variable_list forward(AutogradContext* ctx, int64_t plan_address, const std::optional<at::Tensor>& a,
                               const std::optional<at::Tensor>& b, const std::optional<at::Tensor>& c) {
    Plan& plan = *reinterpret_cast<Plan*>(plan_address);
    std::vector<at::Tensor> slots;
    slots.reserve(3 + plan.held.size() + plan.forward.outputs.size());
    for (const auto* t : {&a, &b, &c}) slots.push_back(t->has_value() ? **t : at::Tensor());
    slots.insert(slots.end(), plan.held.begin(), plan.held.end());
    run(plan, plan.forward, slots);
    variable_list saved;
    saved.reserve(plan.saved.size());
    for (int64_t s : plan.saved) saved.push_back(slots[s]);
    ctx->save_for_backward(saved);
    ctx->saved_data["plan"] = plan_address;
    variable_list out;
    out.reserve(plan.returned.size());
    for (int64_t s : plan.returned) out.push_back(slots[s]);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Plan& plan = *reinterpret_cast<Plan*>(ctx->saved_data["plan"].toInt());
    variable_list saved = ctx->get_saved_variables();
    bool fallback = false;
    int capturing = 0;
    // A stream being captured gets the Python backward (its single-launch form would bake the per-stream
    // workspace into the graph). Stream 0 (the legacy default stream) cannot be captured.
    if (plan.stream != 0 && g_driver.is_capturing(reinterpret_cast<void*>(plan.stream), &capturing) != 0) {
      fallback = true;
    }
    fallback = fallback || capturing != 0;
    // The kernels belong to the device's primary context, which torch makes current on autograd's device
    // threads; should none be current, the Python backward (torch's own calls) handles it.
    if (!fallback && plan.device.is_cuda() && g_driver.ctx_get_current != nullptr) {
      void* context = nullptr;
      fallback = g_driver.ctx_get_current(&context) != 0 || context == nullptr;
    }
    for (size_t i = 0; i < grads.size() && !fallback; ++i) {
      at::Tensor& g = grads[i];  // its shape is the output's (the engine checks)
      if (!g.defined() || g.scalar_type() != plan.grad_dtypes[i] || g.device() != plan.device) {
        fallback = true;
        break;
      }
      if (!g.is_contiguous()) g = g.contiguous();
      if ((reinterpret_cast<uint64_t>(g.data_ptr()) & 15) != 0) g = g.clone();  // fresh memory: 16-aligned
    }
    variable_list result(4);  // the plan's address, then the 3 tensor inputs
    if (fallback) {
      ++plan.fallbacks;
      py::gil_scoped_acquire gil;
      py::tuple args(grads.size() + saved.size());
      size_t k = 0;
      for (const auto& g : grads) args[k++] = g.defined() ? py::cast(g) : py::none();
      for (const auto& s : saved) args[k++] = s.defined() ? py::cast(s) : py::none();
      py::object out = (*g_fallbacks[plan.fallback])(*args);
      auto items = out.cast<py::tuple>();
      if (items.size() != 3) throw std::runtime_error("fuseformer native: a fallback must return 3 gradients");
      for (size_t i = 0; i < 3; ++i) {
        if (!items[i].is_none()) result[i + 1] = items[i].cast<at::Tensor>();
      }
      return result;
    }
    std::vector<at::Tensor> slots;
    slots.reserve(grads.size() + saved.size() + plan.held.size() + plan.backward.outputs.size());
    slots.insert(slots.end(), grads.begin(), grads.end());
    slots.insert(slots.end(), saved.begin(), saved.end());
    slots.insert(slots.end(), plan.held.begin(), plan.held.end());
    run(plan, plan.backward, slots);
    for (size_t i = 0; i < 3; ++i) {
      if (plan.grads[i] >= 0) result[i + 1] = slots[plan.grads[i]];
    }
    return result;
  }
};

// ---- Python bindings ------------------------------------------------------------------------------

Program make_program(const py::list& outputs, const py::list& launches) {
  Program p;
  for (const auto& o : outputs) {
    auto t = o.cast<py::tuple>();
    p.outputs.push_back(Output{t[0].cast<std::vector<int64_t>>(), t[1].cast<at::ScalarType>()});
  }
  for (const auto& l : launches) {
    auto t = l.cast<py::tuple>();  // (function, (gx, gy, gz), block, shared, [(kind, value), ...])
    Launch launch;
    launch.function = t[0].cast<uint64_t>();
    auto grid = t[1].cast<std::vector<unsigned>>();
    if (grid.size() != 3) throw std::invalid_argument("fuseformer native: a grid has 3 dims");
    launch.grid = {grid[0], grid[1], grid[2]};
    launch.block = t[2].cast<unsigned>();
    launch.shared = t[3].cast<unsigned>();
    for (const auto& a : t[4].cast<py::list>()) {
      auto pair = a.cast<py::tuple>();
      Arg arg{pair[0].cast<int64_t>(), 0, 0.0};
      if (arg.kind == kFloat32) {
        arg.real = pair[1].cast<double>();
      } else if (arg.kind >= kPointer && arg.kind <= kInt64) {
        arg.value = pair[1].cast<int64_t>();
      } else {
        throw std::invalid_argument("fuseformer native: unknown argument kind");
      }
      launch.args.push_back(arg);
    }
    if (launch.args.size() > kMaxArgs) throw std::invalid_argument("fuseformer native: too many kernel arguments");
    p.launches.push_back(std::move(launch));
  }
  return p;
}

void check_slots(const Program& p, size_t first_output, const char* which) {
  const size_t n = first_output + p.outputs.size();
  for (const auto& l : p.launches) {
    for (const auto& a : l.args) {
      if (a.kind == kPointer && (a.value < 0 || static_cast<size_t>(a.value) >= n)) {
        throw std::invalid_argument(std::string("fuseformer native: a ") + which + " launch reads slot " +
                                    std::to_string(a.value) + " of " + std::to_string(n));
      }
    }
  }
}

// Returns the plan's address (what apply takes).
int64_t make_plan(const py::list& fwd_outputs, const py::list& fwd_launches, const py::list& bwd_outputs,
                  const py::list& bwd_launches, const std::vector<at::Tensor>& held,
                  const std::vector<int64_t>& saved, const std::vector<int64_t>& returned,
                  const std::vector<int64_t>& grads, const std::vector<at::ScalarType>& grad_dtypes,
                  int64_t fallback, uint64_t stream, at::Device device) {
  auto plan = std::make_unique<Plan>();
  plan->forward = make_program(fwd_outputs, fwd_launches);
  plan->backward = make_program(bwd_outputs, bwd_launches);
  plan->held = held;
  plan->saved = saved;
  plan->returned = returned;
  plan->grads = grads;
  plan->grad_dtypes = grad_dtypes;
  plan->fallback = fallback;
  plan->stream = stream;
  plan->device = device;
  const size_t fwd_first_out = 3 + held.size();
  const size_t bwd_first_out = returned.size() + saved.size() + held.size();
  check_slots(plan->forward, fwd_first_out, "forward");
  check_slots(plan->backward, bwd_first_out, "backward");
  const size_t fwd_slots = fwd_first_out + plan->forward.outputs.size();
  for (int64_t s : saved) {
    if (s < 0 || static_cast<size_t>(s) >= fwd_slots) throw std::invalid_argument("fuseformer native: bad saved slot");
  }
  for (int64_t s : returned) {
    if (s < 0 || static_cast<size_t>(s) >= fwd_slots) throw std::invalid_argument("fuseformer native: bad returned slot");
  }
  const size_t bwd_slots = bwd_first_out + plan->backward.outputs.size();
  if (grads.size() != 3 || grad_dtypes.size() != returned.size()) {
    throw std::invalid_argument("fuseformer native: grads needs 3 entries and grad_dtypes one per returned output");
  }
  for (int64_t s : grads) {
    if (s >= 0 && static_cast<size_t>(s) >= bwd_slots) throw std::invalid_argument("fuseformer native: bad grad slot");
  }
  if (fallback < 0 || static_cast<size_t>(fallback) >= g_fallbacks.size()) {
    throw std::invalid_argument("fuseformer native: unknown fallback");
  }
  g_plans.push_back(std::move(plan));
  return reinterpret_cast<int64_t>(g_plans.back().get());
}

int64_t register_fallback(py::object fn) {
  g_fallbacks.push_back(new py::object(std::move(fn)));  // never freed (see g_plans)
  return static_cast<int64_t>(g_fallbacks.size()) - 1;
}

variable_list apply(int64_t plan, const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& b,
                    const std::optional<at::Tensor>& c) {
  return NativeFunction::apply(plan, a, b, c);
}

py::tuple plan_counts(int64_t plan_address) {
  const Plan& plan = *reinterpret_cast<Plan*>(plan_address);
  return py::make_tuple(plan.launches.load(), plan.fallbacks.load());
}

}  // namespace fuseformer_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace n = fuseformer_native;
  m.def("load_driver", &n::load_driver, "Find cuLaunchKernel in libcuda.so.1; False without a CUDA driver.");
  m.def("set_driver_for_testing", &n::set_driver_for_testing);
  m.def("make_plan", &n::make_plan);
  m.def("register_fallback", &n::register_fallback);
  m.def("apply", &n::apply, "Run a plan's forward as an autograd node (its backward runs the plan's backward).");
  m.def("plan_counts", &n::plan_counts, "(launches, fallback backward calls) of a plan so far.");
}
