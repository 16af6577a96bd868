"""A fake ``pynvml`` at the function boundary, for driving the NVML backend without a GPU.

:class:`FakeNvml` is a module object with the binding's function names, constants and
error classes (``NVMLError`` maps a code to its ``NVMLError_*`` subclass in ``__new__``
exactly as nvidia-ml-py does). Behaviour follows NVML where the backend cares: calls
before ``nvmlInit`` fail with UNINITIALIZED, strings come back as ``str`` while PCI bus
ids in structs are ``bytes``, a lost GPU answers GPU_IS_LOST, empty MIG slots answer
NOT_FOUND, and ``nvmlEventSetWait_v2`` really blocks for its timeout and raises TIMEOUT.

Tests flip fields on :class:`FakeGpu` (``lost``, ``temperature``, ...) and inject events
with :meth:`FakeNvml.inject_event`. Every call is recorded with the calling thread's id.

``test_nvml_backend.test_fake_matches_real_pynvml`` keeps names and values honest.
"""

from __future__ import annotations

import queue
import string
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tests.fakes import fake_nvml_mig
from tests.fakes.fake_nvml_mig import H100_PROFILES, FakeMigState, MigCalls

# --- constants (values as in nvidia-ml-py) --------------------------------------------

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_UNKNOWN = 999

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_TEMPERATURE_GPU = 0
NVML_NVLINK_MAX_LINKS = 36
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_GPU_INSTANCE_ID_ANY = 0xFFFFFFFF
NVML_COMPUTE_INSTANCE_ID_ANY = 0xFFFFFFFF

NVML_NVLINK_DEVICE_TYPE_GPU = 0x00
NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02

NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_SYSTEM = 50

NVML_DEVICE_ARCH_AMPERE = 7
NVML_DEVICE_ARCH_ADA = 8
NVML_DEVICE_ARCH_HOPPER = 9
NVML_DEVICE_ARCH_BLACKWELL = 10
NVML_DEVICE_ARCH_UNKNOWN = 0xFFFFFFFF

NVML_BRAND_TESLA = 2
NVML_BRAND_GEFORCE = 5
NVML_BRAND_NVIDIA_RTX = 13
NVML_BRAND_NVIDIA = 14

nvmlEventTypeSingleBitEccError = 0x0000000000000001
nvmlEventTypeDoubleBitEccError = 0x0000000000000002
nvmlEventTypeXidCriticalError = 0x0000000000000008

XID = nvmlEventTypeXidCriticalError
DBE = nvmlEventTypeDoubleBitEccError
SBE = nvmlEventTypeSingleBitEccError
ALL_HEALTH_EVENTS = XID | DBE | SBE
MIB = 1024 * 1024


# --- errors, built the way nvidia-ml-py builds them ------------------------------------


class NVMLError(Exception):
    _valClassMapping: ClassVar[dict[int, type[NVMLError]]] = {}
    _errcode_to_string: ClassVar[dict[int, str]] = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
        NVML_ERROR_IN_USE: "In use by another client",
        NVML_ERROR_INSUFFICIENT_RESOURCES: "Ran out of critical resources, other than memory",
        NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }
    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    __hash__ = Exception.__hash__


def _extract_error_classes() -> dict[str, type[NVMLError]]:
    module = sys.modules[__name__]
    classes: dict[str, type[NVMLError]] = {}
    for err_name in [n for n in dir(module) if n.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        err_val = getattr(module, err_name)

        def gen_new(val: int) -> Callable[..., NVMLError]:
            def new(typ: type[NVMLError], *args: object) -> NVMLError:
                return NVMLError.__new__(typ, val)

            return new

        cls = type(class_name, (NVMLError,), {"__new__": gen_new(err_val)})
        cls.__module__ = __name__
        setattr(module, class_name, cls)
        NVMLError._valClassMapping[err_val] = cls
        classes[class_name] = cls
    return classes


ERROR_CLASSES = _extract_error_classes()


# --- structs ------------------------------------------------------------------------


@dataclass
class c_nvmlMemory_t:
    total: int
    free: int
    used: int


@dataclass
class c_nvmlUtilization_t:
    gpu: int
    memory: int


@dataclass
class nvmlPciInfo_t:
    busId: bytes
    domain: int = 0
    bus: int = 0
    device: int = 0
    pciDeviceId: int = 0x233010DE


@dataclass
class c_nvmlEventData_t:
    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = NVML_GPU_INSTANCE_ID_ANY
    computeInstanceId: int = NVML_COMPUTE_INSTANCE_ID_ANY


@dataclass
class c_nvmlDeviceAttributes:
    gpuInstanceSliceCount: int
    memorySizeMB: int


# --- the simulated hardware -----------------------------------------------------------


@dataclass
class FakeMig:
    uuid: str
    gi: int
    ci: int
    name: str
    memory_mib: int
    slices: int


@dataclass
class FakeNvLink:
    remote_bus_id: str
    remote_type: int = NVML_NVLINK_DEVICE_TYPE_GPU
    enabled: bool = True


@dataclass
class FakeGpu:
    uuid: str
    name: str
    minor: int
    bus_id: str  # NVML form, "00000000:18:00.0"
    memory_mib: int
    arch: int = NVML_DEVICE_ARCH_HOPPER
    compute_capability: tuple[int, int] = (9, 0)
    brand: int = NVML_BRAND_NVIDIA
    # sysfs (write_sysfs): the CPU-side NUMA node (None: -1) and the PCIe root complex
    numa_node: int | None = None
    pcie_root: str = "pci0000:00"
    drm: tuple[str, ...] = ()  # entries of /sys/bus/pci/devices/<bus>/drm, e.g. ("card1", "renderD128")
    # what nvmlDeviceGetNumaNodeId answers (None: NOT_SUPPORTED); on Grace the GPU's own memory node
    nvml_numa_node: int | None = None
    mig_enabled: bool | None = False  # None: nvmlDeviceGetMigMode is NOT_SUPPORTED
    max_mig: int = 7
    migs: dict[int, FakeMig] = field(default_factory=dict)  # slot -> MIG device
    invalid_mig_slots: frozenset[int] = frozenset()  # slots answering INVALID_ARGUMENT
    nvlinks: list[FakeNvLink] = field(default_factory=list)  # NOT_SUPPORTED beyond the list
    supported_events: int = ALL_HEALTH_EVENTS
    temperature: int = 45
    memory_supported: bool = True  # False: integrated GPU, memory info NOT_SUPPORTED
    # knobs for faults
    lost: bool = False
    no_permission: bool = False  # nvmlDeviceGetHandleByIndex answers NO_PERMISSION
    register_error: int | None = None  # nvmlDeviceRegisterEvents fails with this code
    uuid_readback: str | None = None  # what nvmlDeviceGetUUID answers instead of uuid
    memory_total_override: int | None = None  # bytes
    temperature_error: int | BaseException | None = None  # NVML code or exception to raise
    # utilization readings
    utilization: int = 0  # percent, nvmlDeviceGetUtilizationRates().gpu
    memory_used_mib: int = 512
    utilization_error: int | None = None  # NVML code nvmlDeviceGetUtilizationRates raises
    #: while set, nvmlDeviceGetUtilizationRates blocks until the event is set (a hung driver call)
    utilization_hang: threading.Event | None = None
    #: MIG profiles, instances and failure knobs (tests/fakes/fake_nvml_mig.py)
    mig: FakeMigState = field(default_factory=FakeMigState)


@dataclass(frozen=True, eq=False)
class Handle:
    """A device handle. As nvidia-ml-py's ``c_nvmlDevice_t`` pointers are, a new object on every
    call (and on every read of an event's ``device``); two handles of one device are equal, as
    the addresses those pointers hold are, never the same object."""

    gpu: FakeGpu
    mig: FakeMig | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other.gpu is self.gpu and other.mig is self.mig

    def __hash__(self) -> int:
        return hash((id(self.gpu), id(self.mig)))


@dataclass(eq=False)
class FakeEventSet:
    registrations: dict[str, int] = field(default_factory=dict)  # GPU uuid -> event mask
    freed: bool = False
    undefined: bool = False  # a registration failed with UNKNOWN: every wait fails until freed
    queue: queue.Queue[c_nvmlEventData_t] = field(default_factory=queue.Queue)


Topology = Callable[[int, int], int]


def _default_topology(a: int, b: int) -> int:
    return NVML_TOPOLOGY_SYSTEM


class FakeNvml(MigCalls, types.ModuleType):
    """The fake module. Construct with the node's GPUs, in NVML index order."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        topology: Topology = _default_topology,
        driver_version: str = "550.54.15",
        cuda_driver_version: int = 12040,
        library_missing: bool = False,
        init_error: int | None = None,
    ) -> None:
        super().__init__("pynvml")
        for module in (sys.modules[__name__], fake_nvml_mig):
            self.__dict__.update(
                {
                    name: getattr(module, name)
                    for name in dir(module)
                    if name.startswith(("NVML_", "nvmlEventType", "NVMLError", "c_nvml", "nvmlPciInfo"))
                }
            )
        self.gpus = gpus
        self.topology = topology
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.library_missing = library_missing
        self.init_error = init_error
        self.init_count = 0
        self.shutdown_calls = 0
        self.nvmlLib: object = None  # nvidia-ml-py's module global: the loaded library
        self.libLoadLock = threading.Lock()
        self.event_sets: list[FakeEventSet] = []
        self.calls: list[tuple[str, int]] = []  # (function, thread id)
        self._lock = threading.Lock()
        self._wait_errors: queue.Queue[int] = queue.Queue()
        self.broken_waits: int | None = None  # every wait fails with this code while set
        self._waits = threading.Condition()
        self.wait_calls = 0

    # --- test controls ------------------------------------------------------------------

    def inject_event(
        self,
        index: int,
        event_type: int,
        data: int = 0,
        *,
        gi: int = NVML_GPU_INSTANCE_ID_ANY,
        ci: int = NVML_COMPUTE_INSTANCE_ID_ANY,
    ) -> None:
        """An event on GPU ``index``: every live set registered for it gets it, like NVML does."""
        gpu = self.gpus[index]
        with self._lock:
            sets = [s for s in self.event_sets if not s.freed and s.registrations.get(gpu.uuid, 0) & event_type]
        for event_set in sets:
            event_set.queue.put(c_nvmlEventData_t(Handle(gpu), event_type, data, gi, ci))

    def inject_wait_error(self, code: int) -> None:
        """The next ``nvmlEventSetWait_v2`` raises NVMLError(code)."""
        self._wait_errors.put(code)

    def break_waits(self, code: int | None) -> None:
        """Every ``nvmlEventSetWait_v2`` fails with ``code`` from now on (None: waits work again)."""
        self.broken_waits = code

    def live_sets(self) -> list[FakeEventSet]:
        with self._lock:
            return [s for s in self.event_sets if not s.freed]

    def wait_for_waits(self, count: int, timeout: float) -> bool:
        """Block until ``nvmlEventSetWait_v2`` has been entered ``count`` times (from a thread)."""
        with self._waits:
            return self._waits.wait_for(lambda: self.wait_calls >= count, timeout)

    def call_threads(self) -> set[int]:
        with self._lock:
            return {tid for _, tid in self.calls}

    def call_names(self) -> list[str]:
        with self._lock:
            return [name for name, _ in self.calls]

    # --- plumbing -----------------------------------------------------------------------

    def _enter(self, name: str, *, needs_init: bool = True) -> None:
        with self._lock:
            self.calls.append((name, threading.get_ident()))
        if needs_init and self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _raise(self, code: int) -> None:
        raise NVMLError(code)

    @staticmethod
    def _gpu_of(handle: Handle) -> FakeGpu:
        if handle.gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return handle.gpu

    # --- init -----------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit", needs_init=False)
        with self.libLoadLock:
            if self.nvmlLib is None:  # nvidia-ml-py: CDLL("libnvidia-ml.so.1") from the loader path
                if self.library_missing:
                    raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
                self.nvmlLib = "libnvidia-ml.so.1 from the loader path"
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.shutdown_calls += 1
        self.init_count -= 1

    # --- system ---------------------------------------------------------------------------

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return self.cuda_driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if gpu.no_permission:
            raise NVMLError(NVML_ERROR_NO_PERMISSION)
        return Handle(self._gpu_of(Handle(gpu)))

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Handle:
        self._enter("nvmlDeviceGetHandleByUUID")
        if any(g.lost for g in self.gpus):  # nvml.h: "if any GPU has fallen off the bus"
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return Handle(gpu)
            for mig in gpu.migs.values():
                if mig.uuid == uuid:
                    return Handle(gpu, mig)
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    # --- device queries ---------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: Handle) -> str:
        self._enter("nvmlDeviceGetUUID")
        gpu = self._gpu_of(handle)
        if handle.mig is not None:
            return handle.mig.uuid
        return gpu.uuid_readback if gpu.uuid_readback is not None else gpu.uuid

    def nvmlDeviceGetMinorNumber(self, handle: Handle) -> int:
        self._enter("nvmlDeviceGetMinorNumber")
        return self._gpu_of(handle).minor

    def nvmlDeviceGetName(self, handle: Handle) -> str:
        self._enter("nvmlDeviceGetName")
        gpu = self._gpu_of(handle)
        return handle.mig.name if handle.mig is not None else gpu.name

    def nvmlDeviceGetArchitecture(self, handle: Handle) -> int:
        self._enter("nvmlDeviceGetArchitecture")
        return self._gpu_of(handle).arch

    def nvmlDeviceGetCudaComputeCapability(self, handle: Handle) -> tuple[int, int]:
        self._enter("nvmlDeviceGetCudaComputeCapability")
        return self._gpu_of(handle).compute_capability

    def nvmlDeviceGetMemoryInfo(self, handle: Handle, version: int | None = None) -> c_nvmlMemory_t:
        self._enter("nvmlDeviceGetMemoryInfo")
        gpu = self._gpu_of(handle)
        if not gpu.memory_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if handle.mig is not None:
            total = handle.mig.memory_mib * MIB
        else:
            total = gpu.memory_total_override if gpu.memory_total_override is not None else gpu.memory_mib * MIB
        used = min(total, gpu.memory_used_mib * MIB)
        return c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetUtilizationRates(self, handle: Handle) -> c_nvmlUtilization_t:
        """As on a real GPU: NOT_SUPPORTED for MIG devices and for a GPU in MIG mode."""
        self._enter("nvmlDeviceGetUtilizationRates")
        gpu = self._gpu_of(handle)
        hang = gpu.utilization_hang
        if hang is not None:
            hang.wait()
        if gpu.utilization_error is not None:
            raise NVMLError(gpu.utilization_error)
        if handle.mig is not None or gpu.mig_enabled:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return c_nvmlUtilization_t(gpu=gpu.utilization, memory=min(100, gpu.utilization // 2))

    def nvmlDeviceGetPciInfo(self, handle: Handle) -> nvmlPciInfo_t:
        self._enter("nvmlDeviceGetPciInfo")
        return nvmlPciInfo_t(busId=self._gpu_of(handle).bus_id.encode())

    def nvmlDeviceGetNumaNodeId(self, handle: Handle) -> int:
        self._enter("nvmlDeviceGetNumaNodeId")
        gpu = self._gpu_of(handle)
        if gpu.nvml_numa_node is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.nvml_numa_node

    def nvmlDeviceGetBrand(self, handle: Handle) -> int:
        self._enter("nvmlDeviceGetBrand")
        return self._gpu_of(handle).brand

    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature")
        gpu = self._gpu_of(handle)
        if isinstance(gpu.temperature_error, int):
            raise NVMLError(gpu.temperature_error)
        if gpu.temperature_error is not None:
            raise gpu.temperature_error
        return gpu.temperature

    # --- MIG ----------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: Handle) -> list[int]:
        self._enter("nvmlDeviceGetMigMode")
        gpu = self._gpu_of(handle)
        if gpu.mig_enabled is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        mode = NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else NVML_DEVICE_MIG_DISABLE
        pending = mode if gpu.mig.pending is None else int(gpu.mig.pending)
        return [mode, pending]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Handle) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount")
        return self._gpu_of(handle).max_mig

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Handle, index: int) -> Handle:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        gpu = self._gpu_of(handle)
        if index >= gpu.max_mig or index in gpu.invalid_mig_slots:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        mig = gpu.migs.get(index)
        if mig is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return Handle(gpu, mig)

    def _mig_of(self, handle: Handle) -> FakeMig:
        self._gpu_of(handle)
        if handle.mig is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return handle.mig

    def nvmlDeviceGetGpuInstanceId(self, handle: Handle) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId")
        return self._mig_of(handle).gi

    def nvmlDeviceGetComputeInstanceId(self, handle: Handle) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId")
        return self._mig_of(handle).ci

    def nvmlDeviceGetAttributes(self, handle: Handle) -> c_nvmlDeviceAttributes:
        self._enter("nvmlDeviceGetAttributes")
        mig = self._mig_of(handle)
        return c_nvmlDeviceAttributes(gpuInstanceSliceCount=mig.slices, memorySizeMB=mig.memory_mib)

    # --- topology -----------------------------------------------------------------------------

    def nvmlDeviceGetTopologyCommonAncestor(self, a: Handle, b: Handle) -> int:
        self._enter("nvmlDeviceGetTopologyCommonAncestor")
        ga, gb = self._gpu_of(a), self._gpu_of(b)
        return self.topology(self.gpus.index(ga), self.gpus.index(gb))

    def _link(self, handle: Handle, link: int) -> FakeNvLink:
        gpu = self._gpu_of(handle)
        if not 0 <= link < NVML_NVLINK_MAX_LINKS:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if link >= len(gpu.nvlinks):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.nvlinks[link]

    def nvmlDeviceGetNvLinkState(self, handle: Handle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkState")
        return NVML_FEATURE_ENABLED if self._link(handle, link).enabled else NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Handle, link: int) -> nvmlPciInfo_t:
        self._enter("nvmlDeviceGetNvLinkRemotePciInfo")
        return nvmlPciInfo_t(busId=self._link(handle, link).remote_bus_id.encode())

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Handle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkRemoteDeviceType")
        return self._link(handle, link).remote_type

    # --- events -------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._enter("nvmlEventSetCreate")
        event_set = FakeEventSet()
        with self._lock:
            self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: Handle, event_types: int, event_set: FakeEventSet) -> None:
        self._enter("nvmlDeviceRegisterEvents")
        gpu = self._gpu_of(handle)
        if gpu.register_error is not None:
            if gpu.register_error == NVML_ERROR_UNKNOWN:
                event_set.undefined = True
            raise NVMLError(gpu.register_error)
        if event_types & ~gpu.supported_events:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        event_set.registrations[gpu.uuid] = event_set.registrations.get(gpu.uuid, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: FakeEventSet, timeoutms: int) -> c_nvmlEventData_t:
        self._enter("nvmlEventSetWait_v2")
        if event_set.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        with self._waits:
            self.wait_calls += 1
            self._waits.notify_all()
        if event_set.undefined:
            raise NVMLError(NVML_ERROR_UNKNOWN)
        if self.broken_waits is not None:
            raise NVMLError(self.broken_waits)
        try:
            raise NVMLError(self._wait_errors.get_nowait())
        except queue.Empty:
            pass
        try:
            return event_set.queue.get(timeout=timeoutms / 1000)
        except queue.Empty:
            raise NVMLError(NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, event_set: FakeEventSet) -> None:
        self._enter("nvmlEventSetFree")
        event_set.freed = True


# --- scenario nodes ---------------------------------------------------------------------

H100_BUS = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]
NVSWITCH_BUS = ["00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0"]


def h100_node(**kwargs: Any) -> FakeNvml:
    """DGX/HGX H100: 8 GPUs, 18 NVLinks each into 4 NVSwitches, 2 NUMA nodes (GPUs 0-3, 4-7).

    MIG-capable (the H100 80GB profiles), MIG mode off."""
    gpus = [
        FakeGpu(
            uuid=f"GPU-h100-{i:04d}-0000-0000-0000-00000000000{i}",
            name="NVIDIA H100 80GB HBM3",
            minor=i,
            bus_id=f"00000000:{bus}:00.0",
            memory_mib=81559,
            numa_node=0 if i < 4 else 1,
            pcie_root="pci0000:00" if i < 4 else "pci0000:80",
            nvlinks=[FakeNvLink(NVSWITCH_BUS[link % 4], NVML_NVLINK_DEVICE_TYPE_SWITCH) for link in range(18)],
            mig=FakeMigState(profiles=H100_PROFILES),
        )
        for i, bus in enumerate(H100_BUS)
    ]

    def topology(a: int, b: int) -> int:
        if a // 2 == b // 2:
            return NVML_TOPOLOGY_SINGLE
        if a // 4 == b // 4:
            return NVML_TOPOLOGY_NODE
        return NVML_TOPOLOGY_SYSTEM

    return FakeNvml(gpus, topology=topology, **kwargs)


A100_BUS = ["00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000000:4E:00.0"]
A100_NAME = "NVIDIA A100-SXM4-40GB"


def _mig(gpu: int, gi: int, ci: int, profile: str | None, memory_mib: int, slices: int) -> FakeMig:
    name = f"{A100_NAME} MIG {profile}" if profile else A100_NAME
    return FakeMig(f"MIG-a100{gpu}-gi{gi:02d}-ci{ci}", gi, ci, name, memory_mib, slices)


def a100_mig_node(**kwargs: Any) -> FakeNvml:
    """HGX A100 4-GPU: direct NVLinks (4 to each peer), NUMA only in sysfs, mixed MIG.

    Minors are not the indexes (2, 3, 0, 1), so MIG capability minors must be keyed by minor.
    GPU 0: 3g.20gb + 2g.10gb + 1g.5gb + 1g.5gb (slots 1, 3 and 6 empty); GPU 1: 7g.40gb;
    GPU 2: MIG disabled; GPU 3: one MIG device whose name carries no profile (2 slices).
    """
    migs = {
        0: {0: _mig(0, 1, 0, "3g.20gb", 19968, 3), 2: _mig(0, 5, 0, "2g.10gb", 9856, 2),
            4: _mig(0, 13, 0, "1g.5gb", 4864, 1), 5: _mig(0, 14, 0, "1g.5gb", 4864, 1)},
        1: {0: _mig(1, 0, 0, "7g.40gb", 40192, 7)},
        2: {},
        3: {0: _mig(3, 3, 0, None, 9856, 2)},
    }  # fmt: skip
    gpus = []
    for i, bus in enumerate(A100_BUS):
        peers = [p for p in range(4) if p != i]
        gpus.append(
            FakeGpu(
                uuid=f"GPU-a100-{i:04d}-0000-0000-0000-00000000000{i}",
                name=A100_NAME,
                minor=[2, 3, 0, 1][i],
                bus_id=bus,
                memory_mib=40960,
                arch=NVML_DEVICE_ARCH_AMPERE,
                compute_capability=(8, 0),
                numa_node=[0, 0, 1, None][i],
                mig_enabled=i != 2,
                migs=migs[i],
                nvlinks=[FakeNvLink(A100_BUS[peers[link % 3]]) for link in range(12)],
            )
        )

    def topology(a: int, b: int) -> int:
        return NVML_TOPOLOGY_SINGLE if a // 2 == b // 2 else NVML_TOPOLOGY_SYSTEM

    return FakeNvml(gpus, topology=topology, **kwargs)


def gh200_node(**kwargs: Any) -> FakeNvml:
    """A Grace Hopper superchip: the GPU's PCI device sits on the CPU's NUMA node 0, while
    nvmlDeviceGetNumaNodeId answers the GPU's own memory node (1, a node without CPUs)."""
    gpu = FakeGpu(
        uuid="GPU-gh200-0000-0000-0000-000000000000",
        name="NVIDIA GH200 480GB",
        minor=0,
        bus_id="00000009:01:00.0",
        memory_mib=97871,
        numa_node=0,
        nvml_numa_node=1,
        pcie_root="pci0009:00",
    )
    return FakeNvml([gpu], **kwargs)


def write_sysfs(root: Path, gpus: list[FakeGpu]) -> Path:
    """The sysfs tree the backend reads, under ``root`` (its ``/sys``); returns ``root``.

    Each GPU's device directory sits below its PCIe root and one bridge, like the kernel
    lays it out, and ``bus/pci/devices/<bus id>`` is a relative link to it.
    """
    for gpu in gpus:
        domain, rest = gpu.bus_id.split(":", 1)
        bdf = f"{int(domain, 16):04x}:{rest}".lower()
        bridge = f"{bdf[:4]}:{gpu.pcie_root[-2:]}:01.0"
        device = root / "devices" / gpu.pcie_root / bridge / bdf
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{-1 if gpu.numa_node is None else gpu.numa_node}\n")
        for entry in gpu.drm:
            (device / "drm" / entry).mkdir(parents=True)
        link = root / "bus" / "pci" / "devices" / bdf
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../../..") / "devices" / gpu.pcie_root / bridge / bdf)
    return root
