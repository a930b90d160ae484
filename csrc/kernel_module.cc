#include "kernel_module.h"

#include <cstdint>
#include <cstring>
#include <string>

namespace jax_kda {
namespace {

const char* RequestName(contract::Kernels kernels) {
  switch (kernels) {
    case contract::Kernels::kForDevice:
      return "backend=\"auto\"";
    case contract::Kernels::kSm90:
      return "backend=\"sm90\"";
    case contract::Kernels::kSm100:
      return "backend=\"sm100\"";
    case contract::Kernels::kMmaSyncOnSm90:
      return "the mma.sync kernels built for sm_90a (testing)";
  }
  return "an unknown kernels request";
}

}  // namespace

const char* ArchForComputeCapability(int major, int minor) {
  for (const contract::ArchInfo& arch : contract::kArchs) {
    if (arch.major == major && arch.minor == minor) return arch.name;
  }
  return nullptr;
}

std::string CudaErrorText(cudaError_t error) {
  return std::string(cudaGetErrorName(error)) + " (" + cudaGetErrorString(error) + ")";
}

const std::string& KernelModules::Load() {
  std::call_once(once_, [this] { load_error_ = LoadAll(); });
  return load_error_;
}

std::string KernelModules::LoadAll() {
  int device_count = 0;
  if (cudaError_t error = cudaGetDeviceCount(&device_count); error != cudaSuccess) {
    return "jax_kda: cudaGetDeviceCount failed: " + CudaErrorText(error);
  }
  devices_.resize(device_count);
  for (Device& d : devices_) {
    for (auto& by_variant : d.exports) by_variant.fill(-1);  // nothing served until resolved below
  }
  for (int device = 0; device < device_count; ++device) {
    Device& d = devices_[device];
    cudaError_t error = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device);
    if (error == cudaSuccess) error = cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, device);
    if (error == cudaSuccess) {
      error = cudaDeviceGetAttribute(&d.multiprocessors, cudaDevAttrMultiProcessorCount, device);
    }
    if (error != cudaSuccess) {
      return "jax_kda: reading the attributes of CUDA device " + std::to_string(device) +
             " failed: " + CudaErrorText(error);
    }
    // Which export serves each request and gate variant on this device.
    const char* arch = ArchForComputeCapability(d.major, d.minor);
    for (const contract::KernelChoice& choice : contract::kKernelChoices) {
      if (arch == nullptr || std::strcmp(choice.arch, arch) != 0) continue;
      for (size_t i = 0; i < objects_.size(); ++i) {
        const ExportedObject& e = objects_[i];
        if (std::strcmp(e.object, choice.object) == 0 && e.gate_variant >= 0 &&
            e.gate_variant < contract::kNumGateVariants) {
          d.exports[static_cast<int>(choice.kernels)][e.gate_variant] = static_cast<int>(i);
        }
      }
    }
  }

  for (const ExportedObject& object : objects_) {
    bool library_loaded = false;
    for (int device = 0; device < device_count; ++device) {
      Device& d = devices_[device];
      const char* arch = ArchForComputeCapability(d.major, d.minor);
      if (arch == nullptr || std::strcmp(arch, object.arch) != 0 || !d.load_error.empty()) continue;

      // The argument packing of the exported entry points, as the generated header spells it:
      // init(&library_ptr, &ret) and load_to_device(&library_ptr, &device, &ret).
      cudaLibrary_t* library_ptr = object.library;
      cudaError_t ret = cudaSuccess;
      if (!library_loaded) {
        void* init_args[] = {&library_ptr, &ret};
        object.init(init_args);
        if (ret != cudaSuccess) {
          return std::string("jax_kda: loading the kernel object ") + object.name + " failed: " + CudaErrorText(ret);
        }
        library_loaded = true;
      }
      int32_t device_id = device;
      void* load_args[] = {&library_ptr, &device_id, &ret};
      object.load_to_device(load_args);
      if (ret != cudaSuccess) {
        d.load_error = std::string("jax_kda: loading the kernel object ") + object.name + " onto CUDA device " +
                       std::to_string(device) + " (compute capability " + std::to_string(d.major) + "." +
                       std::to_string(d.minor) + ") failed: " + CudaErrorText(ret);
      }
    }
  }
  return {};
}

int KernelModules::Resolve(contract::Kernels kernels, int gate_variant, int device, std::string* error) const {
  const int request = static_cast<int>(kernels);
  if (request < 0 || request >= contract::kNumKernels || gate_variant < 0 ||
      gate_variant >= contract::kNumGateVariants) {
    *error = "jax_kda: unknown kernels request " + std::to_string(request) + " or gate variant " +
             std::to_string(gate_variant) + " (a jax_kda Python/extension version mismatch?)";
    return -1;
  }
  if (device < 0 || device >= static_cast<int>(devices_.size())) {
    *error = "jax_kda: CUDA device " + std::to_string(device) + " is not among the " +
             std::to_string(devices_.size()) + " devices seen when the kernels were loaded";
    return -1;
  }
  const Device& d = devices_[device];
  if (!d.load_error.empty()) {
    *error = d.load_error;
    return -1;
  }
  if (d.exports[request][gate_variant] >= 0) return d.exports[request][gate_variant];
  std::string serves;
  for (const contract::KernelChoice& choice : contract::kKernelChoices) {
    if (choice.kernels != kernels) continue;
    for (const contract::ArchInfo& arch : contract::kArchs) {
      if (std::strcmp(arch.name, choice.arch) == 0) {
        serves += (serves.empty() ? "" : " or ") + std::to_string(arch.major) + "." + std::to_string(arch.minor);
      }
    }
  }
  *error = std::string("jax_kda: CUDA device ") + std::to_string(device) + " has compute capability " +
           std::to_string(d.major) + "." + std::to_string(d.minor) + "; the kernels of " + RequestName(kernels) +
           " run on compute capability " + serves +
           ". Pass backend=\"xla\" (or lower this computation for another platform) to run the portable path.";
  return -1;
}

int KernelModules::MultiprocessorCount(int device) const {
  if (device < 0 || device >= static_cast<int>(devices_.size())) return 0;
  return devices_[device].multiprocessors;
}

}  // namespace jax_kda
