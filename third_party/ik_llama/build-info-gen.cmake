# Writes common/build-info.cpp from common/build-info.cpp.in. The ik-llama-cpp-python sdist
# ships without upstream's generator, so basetree.py installs this one as
# common/cmake/build-info-gen-cpp.cmake. Run by common/CMakeLists.txt with the tree root as
# the working directory.

set(BUILD_NUMBER 0)
set(BUILD_COMMIT "unknown")

# A prepared tree records the pinned commit; an exported developer tree has git history.
if(EXISTS ".ikdflash-base")
    file(STRINGS ".ikdflash-base" _commit REGEX "^commit=")
    string(REPLACE "commit=" "" BUILD_COMMIT "${_commit}")
else()
    execute_process(COMMAND git rev-parse --short HEAD OUTPUT_VARIABLE _head
                    RESULT_VARIABLE _rc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_rc EQUAL 0)
        set(BUILD_COMMIT "${_head}")
        execute_process(COMMAND git rev-list --count HEAD OUTPUT_VARIABLE BUILD_NUMBER
                        OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    endif()
endif()

set(BUILD_COMPILER "${CMAKE_C_COMPILER_ID} ${CMAKE_C_COMPILER_VERSION}")
execute_process(COMMAND "${CMAKE_C_COMPILER}" -dumpmachine OUTPUT_VARIABLE BUILD_TARGET
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)

set(_out "common/build-info.cpp")
configure_file("common/build-info.cpp.in" "${_out}.tmp" @ONLY)
# Only touch the file when its content changes, so rebuilds stay incremental.
file(COPY_FILE "${_out}.tmp" "${_out}" ONLY_IF_DIFFERENT)
file(REMOVE "${_out}.tmp")
