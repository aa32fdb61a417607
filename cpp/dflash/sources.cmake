# The DFlash runtime, compiled into the fork's libllama. The fork's src/CMakeLists.txt includes
# this file when IKDFLASH_SOURCE_DIR names an ikdflash checkout (patch "build: hook ikdflash's
# runtime into libllama"); the package build sets it, C++ developers pass it to CMake.
target_sources(llama PRIVATE
    ${CMAKE_CURRENT_LIST_DIR}/dflash-adapt.cpp
    ${CMAKE_CURRENT_LIST_DIR}/dflash-args.cpp
    ${CMAKE_CURRENT_LIST_DIR}/dflash-draft.cpp
    ${CMAKE_CURRENT_LIST_DIR}/dflash-engine.cpp
    ${CMAKE_CURRENT_LIST_DIR}/dflash-faults.cpp
    ${CMAKE_CURRENT_LIST_DIR}/dflash-gguf-check.cpp
    ${CMAKE_CURRENT_LIST_DIR}/dflash-mask.cpp
    ${CMAKE_CURRENT_LIST_DIR}/dflash-sampler.cpp)
# dflash.h is public API of libllama, like llama.h
target_include_directories(llama PUBLIC ${CMAKE_CURRENT_LIST_DIR})
