# Imported by the forkserver of each pytest process that tools/test-upstream runs, before it forks the ranks of
# upstream's DistributedTest (multiprocessing.set_forkserver_preload). Each rank then starts with torch, DeepSpeed
# and the test file already imported instead of importing them again, the same for stock and the series. Nothing
# here changes what a test runs.
import importlib
import os
import sys

# The pytest process's sys.path (its rootdir and test folders), which this forkserver does not have yet.
for _p in os.environ.get("UPSTREAM_PRELOAD_SYS_PATH", "").split(os.pathsep):
    if _p and _p not in sys.path:
        sys.path.append(_p)

import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (torch.optim's Optimizer imports it on first use)
import deepspeed  # noqa: F401
import deepspeed.runtime.engine  # noqa: F401

# The engine asks whether an optimizer is supported by ZeRO, which imports the Muon optimizer, which compiles.
try:
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
except ImportError:
    pass

# DeepSpeed's op builders ask py-cpuinfo for the CPU's flags each time a rank loads a JIT op (FusedAdam, CPU Adam):
# py-cpuinfo starts a Python subprocess to read them, about 1 s each. Ask once here; the ranks inherit the answer.
try:
    import cpuinfo
    _info = cpuinfo.get_cpu_info()
    cpuinfo.get_cpu_info = lambda: dict(_info)
except Exception:  # py-cpuinfo missing or failing: the builders fall back to lscpu, as they do without this
    pass

# The test files of this pytest process (tools/test-upstream names them), imported as pytest imported them.
for name in filter(None, os.environ.get("UPSTREAM_PRELOAD_MODULES", "").split(",")):
    try:
        importlib.import_module(name)
    except Exception:  # a rank imports it again and reports the error as it would have
        pass
