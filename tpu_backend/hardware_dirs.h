// Where the shipped hardware tables (<name>.toml, tpu_backend/hardware.h) are found, so that an installed
// shardstep reads the installed copies (<prefix>/share/shardstep/hardware) and a build tree its source
// tree's. Looked up in this order, the first directory that holds a *.toml winning:
//   1. $SHARDSTEP_HARDWARE_DIR, when set (an explicit choice; an error when it holds no table);
//   2. next to the running program as installed: <dir of the executable>/../share/shardstep/hardware
//      (the `shardstep` command and any program installed in <prefix>/bin);
//   3. the source tree the library was built from (tpu_backend/hardware: a build tree);
//   4. the install prefix the build was configured with (<CMAKE_INSTALL_PREFIX>/share/shardstep/hardware:
//      a program linked against an installed library, once the source tree is gone).
#pragma once

#include <string>
#include <vector>

namespace shardstep::tpu {

// The directories of the lookup, in order (those that are not configured are left out).
std::vector<std::string> HardwareTableSearchPath();
// The first directory of the search path holding a *.toml; throws shardstep::Error naming every
// directory looked in when none does.
std::string HardwareTableDir();

}  // namespace shardstep::tpu
