// registry.h — kernels by name, for the fake driver's cuModuleGetFunction / cuLaunchKernel.
//
// build.rs lists each kernel file's `extern "C"` kernels (from its preprocessed text) and
// registers them after the file's code with CUEMU_REGISTER. A kernel's entry binds a launch's
// argument array (`void** kernelParams`, one pointer per argument, as cuLaunchKernel takes
// it) by copying each argument by its declared type, so a captured launch keeps its values.
#pragma once

#include <cstddef>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace cuemu {
using Bound = std::function<void()>;
using Binder = Bound (*)(void** params);

void register_kernel(const char* name, Binder bind);
// The binder of `name`, or null.
Binder find_kernel(const char* name);

template <typename... Args, std::size_t... I>
Bound bind_args(void (*kernel)(Args...), void** params, std::index_sequence<I...>) {
    auto args = std::make_tuple(*static_cast<std::decay_t<Args>*>(params[I])...);
    return [kernel, args]() { std::apply(kernel, args); };
}

template <typename... Args>
constexpr auto arity_sequence(void (*)(Args...)) {
    return std::index_sequence_for<Args...>{};
}

struct Registrar {
    Registrar(const char* name, Binder bind) { register_kernel(name, bind); }
};
}  // namespace cuemu

// Registers `ns::name` under "name"; `ns` is the namespace build.rs wrapped the file in.
#define CUEMU_REGISTER(ns, name)                                                          \
    static cuemu::Registrar cuemu_registrar_##name(#name, [](void** params) {             \
        return cuemu::bind_args(&ns::name, params,                                        \
                                cuemu::arity_sequence(&ns::name));                        \
    })

