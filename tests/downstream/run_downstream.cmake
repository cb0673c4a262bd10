# ctest downstream_package: installs the build (-DBINARY_DIR) into a fresh prefix under -DWORK_DIR,
# configures and builds tests/downstream (-DSOURCE_DIR) against it with find_package(shardstep), and runs
# the program, which trains a small model and fails unless its loss falls.
#   cmake -DBINARY_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... [-DCXX=...] [-DLAUNCHER=ccache] -P run_downstream.cmake
foreach(var BINARY_DIR SOURCE_DIR WORK_DIR)
  if(NOT ${var})
    message(FATAL_ERROR "run_downstream.cmake: -D${var}=... is required")
  endif()
endforeach()

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR}/prefix ${WORK_DIR}/build)
run("install" ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${WORK_DIR}/prefix)
if(NOT EXISTS ${WORK_DIR}/prefix/lib/cmake/shardstep/shardstepConfig.cmake)
  message(FATAL_ERROR "the install put no lib/cmake/shardstep/shardstepConfig.cmake under ${WORK_DIR}/prefix")
endif()
# The simulator's hardware tables are installed (share/shardstep/hardware), and the installed `shardstep` reads
# those, not the source tree's (tpu_backend/hardware_dirs.h): a table only the install has is found.
set(hardware_dir ${WORK_DIR}/prefix/share/shardstep/hardware)
if(NOT EXISTS ${hardware_dir}/tpu-v3.toml)
  message(FATAL_ERROR "the install put no share/shardstep/hardware/tpu-v3.toml under ${WORK_DIR}/prefix")
endif()
if(EXISTS ${WORK_DIR}/prefix/bin/shardstep)
  configure_file(${hardware_dir}/tpu-v3.toml ${hardware_dir}/tpu-installed-only.toml COPYONLY)
  run("installed shardstep simulate --hardware tpu-installed-only" ${CMAKE_COMMAND} -E env --unset=SHARDSTEP_HARDWARE_DIR
      ${WORK_DIR}/prefix/bin/shardstep simulate --model mlp --hidden 16 --mesh 2x2 --per-core-batch 2
      --hardware tpu-installed-only)
  if(NOT last_output MATCHES "tpu-installed-only")
    message(FATAL_ERROR "the installed shardstep did not simulate on the installed table:\n${last_output}")
  endif()
endif()
set(configure_args -S ${SOURCE_DIR} -B ${WORK_DIR}/build -DCMAKE_BUILD_TYPE=Release
                   -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
if(CXX)
  list(APPEND configure_args -DCMAKE_CXX_COMPILER=${CXX})
endif()
if(LAUNCHER)  # ccache: the one source file compiles again only when a header changed
  list(APPEND configure_args -DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER})
endif()
find_program(NINJA ninja)
if(NINJA)
  list(APPEND configure_args -G Ninja)
endif()
run("configure the downstream project" ${CMAKE_COMMAND} ${configure_args})
run("build it" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run("run it" ${WORK_DIR}/build/downstream_app)
message(STATUS "${last_output}")
