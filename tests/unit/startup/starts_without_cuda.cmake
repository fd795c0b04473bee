# Checks that the metile command needs no CUDA library to start (NVRTC, cuBLASLt and libcuda
# are dlopen'ed on first use: src/runtime/cuda/cuda_libraries.h, cuda_driver.h).
#   cmake -DMETILE=path -DEXAMPLES=dir -DFLOW_DATA=dir [-DTOOLKIT_LIBRARY_FOLDER=dir] -P starts_without_cuda.cmake
# 1. ldd lists no libcuda, libnvrtc or libcublas (and does list libc: ldd really read the binary).
# 2. The loader, told to ignore its cache (ld.so --inhibit-cache) with LD_LIBRARY_PATH empty and
#    tracing its searches (LD_DEBUG=libs), runs `metile plan` and `metile maxflow` to the right
#    answers and never looks for a CUDA library.
# 3. Where a private mount namespace is allowed (unshare), the toolkit's library folder is
#    covered by an empty tmpfs and both commands run again, with the same answers.
set(plan_expected "R1 residual_add_rms_norm: 2 ops")
set(maxflow_expected "flow 23")  # CLRS figure 26.1's maximum flow
set(cuda_libraries "libcuda|libnvrtc|libcublas")

execute_process(COMMAND ldd ${METILE} RESULT_VARIABLE ldd_exit OUTPUT_VARIABLE ldd_out ERROR_VARIABLE ldd_err)
if(NOT ldd_exit EQUAL 0 OR NOT ldd_out MATCHES "libc\\.so")
  message(FATAL_ERROR "ldd ${METILE} failed (${ldd_exit}):\n${ldd_out}${ldd_err}")
endif()
if(ldd_out MATCHES "(${cuda_libraries})[^\n]*")
  message(FATAL_ERROR "metile links a CUDA library at load time: ${CMAKE_MATCH_0}\n${ldd_out}")
endif()
string(REGEX MATCH "(/[^ \t\n]*ld-linux[^ \t\n]*)" loader "${ldd_out}")
if(NOT loader)
  message(FATAL_ERROR "no dynamic loader in ldd's output:\n${ldd_out}")
endif()

# Runs `prefix... metile args...`; checks exit 0 and `expected` on stdout; returns stderr in `trace`.
function(run_metile expected trace)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE exit_code OUTPUT_VARIABLE out ERROR_VARIABLE err)
  list(JOIN ARGN " " command_line)
  if(NOT exit_code EQUAL 0 OR NOT out MATCHES "${expected}")
    message(FATAL_ERROR "${command_line}: exit ${exit_code}, expected 0 and '${expected}'\nstdout:\n${out}\nstderr:\n${err}")
  endif()
  set(${trace} "${err}" PARENT_SCOPE)
endfunction()

set(plan_args plan ${EXAMPLES}/add_rms_norm.json)
set(maxflow_args maxflow ${FLOW_DATA}/clrs.max)
foreach(kind plan maxflow)
  run_metile("${${kind}_expected}" trace env LD_LIBRARY_PATH= LD_DEBUG=libs ${loader} --inhibit-cache ${METILE}
             ${${kind}_args})
  if(NOT trace MATCHES "find library=libfmt")
    message(FATAL_ERROR "LD_DEBUG=libs traced no library search; the check below would prove nothing:\n${trace}")
  endif()
  if(trace MATCHES "(${cuda_libraries})[^\n]*")
    message(FATAL_ERROR "metile ${kind} made the loader look for a CUDA library: ${CMAKE_MATCH_0}")
  endif()
endforeach()

if(TOOLKIT_LIBRARY_FOLDER AND IS_DIRECTORY "${TOOLKIT_LIBRARY_FOLDER}")
  find_program(unshare unshare)
  set(hidden_ok 1)
  if(unshare)
    execute_process(COMMAND ${unshare} --mount --map-root-user sh -c "mount -t tmpfs none '${TOOLKIT_LIBRARY_FOLDER}'"
                    RESULT_VARIABLE hidden_ok OUTPUT_QUIET ERROR_QUIET)
  endif()
  if(hidden_ok EQUAL 0)
    foreach(kind plan maxflow)
      # The shell first proves the folder is empty (no libnvrtc left to find), then runs metile.
      run_metile("${${kind}_expected}" trace ${unshare} --mount --map-root-user sh -c
                 "mount -t tmpfs none '${TOOLKIT_LIBRARY_FOLDER}' && ! ls '${TOOLKIT_LIBRARY_FOLDER}' | grep -q . && exec env LD_LIBRARY_PATH= \"$@\""
                 sh ${METILE} ${${kind}_args})
      if(NOT trace STREQUAL "")
        message(FATAL_ERROR "metile ${kind} with ${TOOLKIT_LIBRARY_FOLDER} hidden wrote to stderr:\n${trace}")
      endif()
    endforeach()
    message(STATUS "ran with ${TOOLKIT_LIBRARY_FOLDER} hidden under a private mount")
  else()
    message(STATUS "no private mount namespace here; the loader checks above stand alone")
  endif()
endif()
