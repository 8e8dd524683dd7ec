"""Does compute-sanitizer racecheck understand a named-barrier hand-off (bar.arrive -> bar.sync)?

flash-sm90 hands shared memory between warpgroups that way; this probe tells a racecheck report on
it apart from a real race. Run each mode under racecheck and read its hazard summary:

    compute-sanitizer --tool racecheck python3 scripts/racecheck_probe.py MODE

  none     : warp 0 writes, warp 1 reads, no barrier (a real race: must be reported)
  sync     : both warps bar.sync between write and read (clean)
  arrive   : warp 0 writes then bar.arrive, warp 1 bar.sync then reads (clean by the PTX memory model)
  pingpong : arrive hand-off both ways over 4 rounds, the buffer rewritten each round (clean by
             the PTX memory model)
  flash    : flash-sm90's alpha hand-off: warp 0 writes buffer i%2 after syncing "tile i" (which
             warps 1-2 arrive at after reading buffer i-2), then all three warps bar.sync "P full"
             and warps 1-2 read it; 8 rounds (clean: every read of round i precedes P full i+1,
             which precedes the write of round i+2)
"""
import sys

import cupy as cp

SRC = r"""
extern "C" __global__ void probe(float* out, int mode) {
  __shared__ float buf[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float acc = 0.f;
  for (int round = 0; round < (mode == 3 ? 4 : mode == 4 ? 0 : 1); ++round) {
    if (warp == 0) {
      if (mode == 3 && round > 0) asm volatile("bar.sync 2, 64;" ::: "memory");  // buffer free
      buf[(lane + round) & 31] = lane + round;
      if (mode == 1) {}
      else if (mode == 0) asm volatile("bar.sync 1, 64;" ::: "memory");
      else asm volatile("bar.arrive 1, 64;" ::: "memory");
    } else {
      if (mode == 1) {}
      else asm volatile("bar.sync 1, 64;" ::: "memory");
      acc += buf[lane ^ 1];
      if (mode == 3 && round < 3) asm volatile("bar.arrive 2, 64;" ::: "memory");  // done reading
    }
  }
  if (mode == 4) {  // flash: barriers 1-2 "P full" (96, all sync), 3-4 "tile" (consumers arrive, producer syncs)
    if (warp > 0) asm volatile("bar.arrive 3, 96;" ::: "memory");  // tile 0
    for (int i = 0; i < 8; ++i) {
      const int st = i & 1;
      if (warp == 0) {
        asm volatile("bar.sync %0, 96;" ::"r"(3 + st) : "memory");
        buf[st * 16 + (lane & 15)] = i + lane;
        asm volatile("bar.sync %0, 96;" ::"r"(1 + st) : "memory");
      } else {
        asm volatile("bar.sync %0, 96;" ::"r"(1 + st) : "memory");
        acc += buf[st * 16 + (lane & 15)];
        if (i + 1 < 8) asm volatile("bar.arrive %0, 96;" ::"r"(3 + ((i + 1) & 1)) : "memory");
      }
    }
  }
  if (warp == 1) out[lane] = acc;
}
"""
MODES = {"sync": 0, "none": 1, "arrive": 2, "pingpong": 3, "flash": 4}

mode = MODES[sys.argv[1]]
kern = cp.RawKernel(SRC, "probe")
out = cp.zeros(32, cp.float32)
kern((1,), (96 if mode == 4 else 64,), (out, cp.int32(mode)))
cp.cuda.runtime.deviceSynchronize()
print(sys.argv[1], "out[0..3] =", out[:4].get().tolist())
