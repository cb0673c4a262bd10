# The CMake package for C++ users: `cmake --install <build> --prefix P` puts the public headers under
# P/include/shardstep, the static libraries under P/lib and shardstepConfig.cmake (+ the exported
# targets) under P/lib/cmake/shardstep, so that another project writes
#   find_package(shardstep REQUIRED)
#   target_link_libraries(app PRIVATE shardstep::shardstep)
# as libtorch users do. The libraries are static: the config file finds what they link (LLVM's shared
# library, TBB, oneDNN, OpenMP, xtensor, zlib, threads) with find_dependency, from the same places
# this build found them. Included from the top-level CMakeLists.txt after the libraries are defined.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# Headers include each other from the source root ("api/session.h", "ir/module.h"): that root is
# installed as include/shardstep, so "shardstep/shardstep.h" resolves there as it does in the tree.
set(SS_INSTALL_INCLUDEDIR ${CMAKE_INSTALL_INCLUDEDIR}/shardstep)
set(SS_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/shardstep)
set(ss_package_libs ss_api ${SS_BACKENDS} ss_dsl ss_runtime ss_ir)
foreach(lib ${ss_package_libs})
  target_include_directories(${lib} INTERFACE $<INSTALL_INTERFACE:${SS_INSTALL_INCLUDEDIR}>)
endforeach()

# shardstep::shardstep: everything a C++ user needs (the Session over every backend, the DSL, the
# built-in models, the training loop). The headers need C++20 (std::source_location in the DSL).
add_library(ss_package INTERFACE)
set_target_properties(ss_package PROPERTIES EXPORT_NAME shardstep)
target_link_libraries(ss_package INTERFACE ss_api)
target_compile_features(ss_package INTERFACE cxx_std_20)
add_library(shardstep::shardstep ALIAS ss_package)

install(TARGETS ss_package ${ss_package_libs} EXPORT shardstepTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${SS_INSTALL_INCLUDEDIR})
if(TARGET shardstep)  # the command-line tool
  install(TARGETS shardstep RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
# The headers of the libraries above (not runtime/mpi: MPI is not in the package), and the op table the
# IR headers include. (The hardware tables are data: share/shardstep/hardware, below.)
install(DIRECTORY ${CMAKE_SOURCE_DIR}/shardstep ${CMAKE_SOURCE_DIR}/api ${CMAKE_SOURCE_DIR}/dsl
                  ${CMAKE_SOURCE_DIR}/ir ${CMAKE_SOURCE_DIR}/models ${CMAKE_SOURCE_DIR}/runtime ${CMAKE_SOURCE_DIR}/jit
                  ${CMAKE_SOURCE_DIR}/tpu_backend
        DESTINATION ${SS_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h" PATTERN "*.def" PATTERN "mpi" EXCLUDE PATTERN "hardware" EXCLUDE)
# The tpu-mesh backend's hardware tables (tpu_backend/hardware_dirs.h has the lookup): installed under
# <prefix>/share/shardstep/hardware, found from an installed program as <its bin dir>/../share/shardstep/hardware,
# else from the source tree (a build tree), else from the prefix configured here (an installed library whose
# source tree is gone), or wherever $SHARDSTEP_HARDWARE_DIR says.
set(SS_INSTALL_HARDWARE_DIR ${CMAKE_INSTALL_DATADIR}/shardstep/hardware)
install(DIRECTORY ${CMAKE_SOURCE_DIR}/tpu_backend/hardware/ DESTINATION ${SS_INSTALL_HARDWARE_DIR}
        FILES_MATCHING PATTERN "*.toml")
file(RELATIVE_PATH ss_hardware_from_bin /ss_prefix/${CMAKE_INSTALL_BINDIR} /ss_prefix/${SS_INSTALL_HARDWARE_DIR})
target_compile_definitions(ss_tpu PRIVATE SHARDSTEP_HARDWARE_DIR_FROM_BIN="${ss_hardware_from_bin}"
                           SHARDSTEP_INSTALL_HARDWARE_DIR="${CMAKE_INSTALL_PREFIX}/${SS_INSTALL_HARDWARE_DIR}")

install(EXPORT shardstepTargets NAMESPACE shardstep:: DESTINATION ${SS_INSTALL_CMAKEDIR})

# Where this build found the dependencies: the config file looks there first.
set(SS_DEP_LLVM_DIR ${LLVM_DIR})
set(SS_DEP_DNNL_DIR ${dnnl_DIR})
set(SS_DEP_TBB_DIR ${TBB_DIR})
set(SS_DEP_XTENSOR_DIR ${xtensor_DIR})
set(SS_HAS_JIT OFF)
if(SS_BACKENDS)
  set(SS_HAS_JIT ON)
endif()
configure_package_config_file(${CMAKE_SOURCE_DIR}/cmake/shardstepConfig.cmake.in
                              ${CMAKE_BINARY_DIR}/package/shardstepConfig.cmake
                              INSTALL_DESTINATION ${SS_INSTALL_CMAKEDIR}
                              PATH_VARS SS_INSTALL_HARDWARE_DIR)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/package/shardstepConfigVersion.cmake
                                 VERSION 0.1.0 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/package/shardstepConfig.cmake ${CMAKE_BINARY_DIR}/package/shardstepConfigVersion.cmake
        DESTINATION ${SS_INSTALL_CMAKEDIR})
