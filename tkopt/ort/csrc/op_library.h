// tkopt's ONNX Runtime custom-op library shell. The generated source for one model defines
// TKOPT_EXECUTION_PROVIDER, TKOPT_CUDA (0/1), and the table kNodeRuns (fused node name -> the
// function that binds that node's tensors to its TileLang kernel), then includes this header.
//
// Kernels are looked up by node name when ORT creates the kernel, so each fused node runs the
// kernel that was generated for its own dtypes, attributes and static dims; symbolic dims
// (batch, sequence) are read from the input shapes at every call.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace tkopt {

// Runs one fused node: reads inputs, allocates outputs through ORT, launches the kernel on `stream`
// (ORT's compute stream on CUDA, null on CPU). Throws Ort::Exception with a message on misuse.
using NodeRun = void (*)(Ort::KernelContext& ctx, void* stream);

struct NodeEntry {
  const char* op;
  NodeRun run;
  void (*init)();  // one-time kernel set-up (CUDA: shared-memory attributes), may be null
};

const std::unordered_map<std::string, NodeEntry>& node_table();

inline int64_t numel(const std::vector<int64_t>& shape, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end; ++i) n *= shape[i];
  return n;
}

// The tensor's shape at `rank` dims: leading dims merged (rows of a GEMM), or 1s prepended (a mask
// given as (Sq, Skv) for a kernel that reads (B, H, Sq, Skv) with broadcast dims).
inline std::vector<int64_t> view_as_rank(const std::vector<int64_t>& shape, size_t rank) {
  if (shape.size() <= rank) {
    std::vector<int64_t> v(rank - shape.size(), 1);
    v.insert(v.end(), shape.begin(), shape.end());
    return v;
  }
  std::vector<int64_t> v{numel(shape, 0, shape.size() - rank + 1)};
  v.insert(v.end(), shape.end() - (rank - 1), shape.end());
  return v;
}

[[noreturn]] inline void fail(const std::string& node, const std::string& what) {
  ORT_CXX_API_THROW("tkopt node '" + node + "': " + what, ORT_INVALID_ARGUMENT);
}

inline std::vector<int64_t> shape_of(const Ort::ConstValue& v) {
  return v.GetTensorTypeAndShapeInfo().GetShape();
}

inline void expect_dim(const std::string& node, const char* input, const std::vector<int64_t>& shape, int axis,
                       int64_t want) {
  int64_t r = static_cast<int64_t>(shape.size());
  int64_t a = axis < 0 ? axis + r : axis;
  if (a < 0 || a >= r || shape[a] != want)
    fail(node, std::string("input ") + input + " axis " + std::to_string(axis) + " must be " + std::to_string(want) +
                   " (the library was built for that size); got shape rank " + std::to_string(r) +
                   (a >= 0 && a < r ? " with " + std::to_string(shape[a]) : std::string()));
}

inline void expect_rank(const std::string& node, const char* input, const std::vector<int64_t>& shape, size_t rank) {
  if (shape.size() != rank)
    fail(node, std::string("input ") + input + " must have rank " + std::to_string(rank) + ", got " +
                   std::to_string(shape.size()));
}

inline void expect_int32(const std::string& node, const char* what, int64_t v) {
  if (v < 0 || v > INT32_MAX) fail(node, std::string(what) + " = " + std::to_string(v) + " does not fit the kernel");
}

struct FusedKernel {
  std::string name;
  NodeEntry entry;
  std::once_flag once;

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      Ort::KernelContext ctx(context);
      if (entry.init) std::call_once(once, entry.init);
      void* stream = TKOPT_CUDA ? ctx.GetGPUComputeStream() : nullptr;
      entry.run(ctx, stream);
      return nullptr;
    } catch (const Ort::Exception& e) {
      return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
    }
  }
};

struct FusedOp : Ort::CustomOpBase<FusedOp, FusedKernel, true> {
  std::string op;
  ONNXTensorElementDataType type;  // of input 0 and every output; ORT picks the op registered for it
  size_t n_inputs, n_outputs;
  std::vector<bool> optional_inputs, optional_outputs;

  FusedOp(std::string op_, int type_, std::vector<bool> opt_in, std::vector<bool> opt_out)
      : op(std::move(op_)), type(static_cast<ONNXTensorElementDataType>(type_)), n_inputs(opt_in.size()),
        n_outputs(opt_out.size()), optional_inputs(std::move(opt_in)), optional_outputs(std::move(opt_out)) {}

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    try {
      Ort::ConstKernelInfo ki(info);
      std::string node = ki.GetNodeName();
      auto it = node_table().find(node);
      if (it == node_table().end() || op != it->second.op)
        return api.CreateStatus(ORT_NOT_IMPLEMENTED,
                                ("tkopt op library has no kernel for " + op + " node '" + node +
                                 "': it was built for another model; rebuild it with `tkopt optimize`")
                                    .c_str());
      auto* k = new FusedKernel();
      k->name = node;
      k->entry = it->second;
      *kernel = k;
      return nullptr;
    } catch (const std::exception& e) {
      return api.CreateStatus(ORT_FAIL, e.what());
    }
  }

  const char* GetName() const { return op.c_str(); }
  const char* GetExecutionProviderType() const { return TKOPT_EXECUTION_PROVIDER; }
  size_t GetInputTypeCount() const { return n_inputs; }
  size_t GetOutputTypeCount() const { return n_outputs; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? type : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  ONNXTensorElementDataType GetOutputType(size_t) const { return type; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return optional_inputs[i] ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return optional_outputs[i] ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
};

std::vector<FusedOp>& fused_ops();  // defined by the generated source: one per fused op type

}  // namespace tkopt

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    // A runtime older than these headers: say so with the oldest API, which every runtime has.
    const OrtApi* v1 = api_base->GetApi(1);
    std::string msg = std::string("tkopt op library was built against ONNX Runtime C API version ") +
                      std::to_string(ORT_API_VERSION) + ", but this runtime is " + api_base->GetVersionString() +
                      "; use onnxruntime >= the version matching API " + std::to_string(ORT_API_VERSION) +
                      " or rebuild the library with older headers (TKOPT_ORT_INCLUDE)";
    return v1->CreateStatus(ORT_FAIL, msg.c_str());
  }
  Ort::InitApi(api);
  try {
    static Ort::CustomOpDomain domain{"tkopt"};
    static bool added = false;
    if (!added) {
      for (auto& op : tkopt::fused_ops()) domain.Add(&op);
      added = true;
    }
    Ort::UnownedSessionOptions(options).Add(domain);
    return nullptr;
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
}
