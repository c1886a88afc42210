// The CPU engine's own kernels (engine/cpu_kernels.py), each where torch's calls spent most of their time
// outside the arithmetic for the few rows of a decode step:
// - w8a8's work around fbgemm's matmul, per token row, in one pass each: quantizing the activations before it and
//   scaling the int32 sums back after (a dozen small torch calls each, which took 2-4x the matmul's own time). The
//   arithmetic is exactly that of the Python fallbacks, operation for operation (no fused multiply-adds: built with
//   -ffp-contract=off), so both paths give the same floats.
// - decode attention straight over the paged KV pool: each row's query against its own slots, without gathering
//   K and V into a padded batch first (the gather and SDPA over it were a quarter of a 16-row decode step).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
// AMX's tiles (bf16 dense matmuls): the instructions, and Linux's call that lets a process use them
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define WATCHLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define WATCHLLM_AMX 0
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

// the kernels' own threads (pool, below): Linux's futex to sleep on, affinity to count the cores
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
inline void cpu_relax() { _mm_pause(); }
#else
inline void cpu_relax() {}
#endif

namespace {
constexpr int64_t kRowsPerTask = 16;
constexpr float kLevels = 255.f;  // uint8
constexpr float kMid = 128.f;     // the zero point fbgemm is given
constexpr float kTiny = 1e-12f;   // an all-zero row's scale (engine/quant.py's _TINY)

void check(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim && t.is_contiguous(),
              what, " must be a contiguous float32 CPU tensor of ", dim, " dimensions");
}

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// A kernel's temporaries: memory of this thread's that grows and is kept, one buffer per use (Use), its contents
// left from the last call. A std::vector a call cost an allocation and a free each, about 40 a layer of a decode
// step, each a few microseconds on a cache the step's weights have just streamed through
enum class Use { kRowsQ, kRowsUnit, kRowsUnitSum, kRowsSums, kCost, kQuery, kAcc, kScores, kQueryBf16, kAt, kNormRow };
template <typename T, Use U>
T* scratch(int64_t n) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(static_cast<size_t>(n));
  return buffer.data();
}
}  // namespace

// ---- the kernels' own threads ------------------------------------------------------------------------------------
// A parallel region that never waits for a thread that has not started its share. at::parallel_for (OpenMP) ends
// each region at a barrier: beside a busy neighbour the OS keeps one of the threads off its core and the other
// waits for it at every one of a step's hundreds of regions (docs/measurements.md, "Beside a busy neighbour").
// Here the calling thread publishes a job (a sequence number and the range of unclaimed chunks in one word), claims
// and runs chunks itself like any worker, and returns once every chunk is done: it waits only for chunks a worker
// has claimed, and a worker that wakes late finds none left. Workers are persistent; each spins a while after a job,
// then sleeps on a futex.
//
// Why a worker never touches a job that has returned: the word's sequence is odd while the job is live. A worker
// claims a chunk by compare-and-swap on the whole word, so a worker preempted between reading the word and claiming
// fails the swap once the job has ended (its caller sets an even sequence before it returns). A successful claim
// holds the job open (its caller waits for that chunk), and a worker claims its next chunk before it reports the
// last one done, so it reads the job's data only while it holds a chunk. What a claim takes is read from the word it
// swaps, nothing beside it, so even a worker whose word's sequence came round again (2^23 jobs later) takes a chunk
// of the job that is live then, and runs that job's.
namespace pool {
// the job word: its sequence (24 bits; odd while a job is live) | its front (20) | its back (20). The calling thread
// claims chunks from the front, workers from the back: at one row each thread of a weight kernel reads its own
// contiguous run of the weights, where chunks dealt out in turn had each thread skip over the other's every few
// kilobytes (docs/measurements.md, "The two ends of a region")
constexpr int kEndBits = 20;
constexpr uint64_t kEndMask = (1ull << kEndBits) - 1;
constexpr int64_t kMaxChunks = static_cast<int64_t>(kEndMask);
inline uint64_t job_word(uint64_t seq, int64_t front, int64_t back) {
  return (seq & 0xFFFFFF) << (2 * kEndBits) | static_cast<uint64_t>(front) << kEndBits | static_cast<uint64_t>(back);
}
inline uint64_t seq_of(uint64_t w) { return w >> (2 * kEndBits); }
inline int64_t front_of(uint64_t w) { return static_cast<int64_t>((w >> kEndBits) & kEndMask); }
inline int64_t back_of(uint64_t w) { return static_cast<int64_t>(w & kEndMask); }

struct Job {
  void* ctx;
  void (*run)(void*, int64_t);  // chunk i
  void (*enter)(void*);         // once, in each thread that takes part, before its first chunk
  void (*leave)(void*);         // once, after its last
};

struct State {
  alignas(64) std::atomic<uint64_t> word{0};  // job_word: the live job's sequence and the chunks not yet claimed
  std::atomic<Job*> job{nullptr};
  std::atomic<int> helpers{0};  // workers 0 .. helpers - 1 take part in this job
  alignas(64) std::atomic<int64_t> done{0};  // chunks finished and reported
  alignas(64) std::atomic<uint32_t> wake{0};  // the futex word the workers sleep on
  std::atomic<int> sleepers{0};
  std::atomic<bool> busy{false};  // one caller at a time; a second one runs its work alone
  std::atomic<int> threads{0};    // what the engine asked for; 0: at::get_num_threads() of the caller
  std::atomic<int64_t> spin_ns{200000};
  std::atomic<int64_t> yield_ns{0};  // after spin_ns, how long to check between sched_yield calls before sleeping
  std::atomic<int> hold{0};       // test hook: 1 stops a worker between reading a job and claiming a chunk
  std::mutex mutex;               // starting workers; the first error
  std::vector<std::thread::id> started;
  std::exception_ptr error;
  // what happened, for the tests
  std::atomic<int64_t> worker_chunks{0}, refused_claims{0}, holds{0};
  // where a caller's time goes (bench probes): regions run on several threads and alone, the time inside them,
  // the time it waited at their ends for a worker's chunks, and how many such waits passed 50 us / 1 ms
  std::atomic<int64_t> regions{0}, alone{0}, region_ns{0}, alone_ns{0}, wait_ns{0}, waits_50us{0}, waits_1ms{0},
      wait_max_ns{0}, worker_sleeps{0};
};

// never destroyed: a worker may still be asleep on it when the process exits
State* state = new State;
thread_local bool in_worker = false;
thread_local bool from_back = false;  // this thread claims from the back of a job's chunks (a worker)
thread_local int thread_slot = 0;     // 0: a calling thread; a worker's index + 1 (what pool_runs reports)

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return std::max(1u, std::thread::hardware_concurrency());
  return std::max(1, CPU_COUNT(&set));
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

void note_error(State& s) {
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.error) s.error = std::current_exception();
}

// word w with the chunk at this thread's end taken, and that chunk in `chunk` (-1 if none is left)
inline uint64_t taken(uint64_t w, int64_t& chunk) {
  const int64_t front = front_of(w), back = back_of(w);
  if (front >= back) {
    chunk = -1;
    return w;
  }
  chunk = from_back ? back - 1 : front;
  return from_back ? w - 1 : w + (1ull << kEndBits);
}

// Claims the next chunk at this thread's end of the live job with sequence `seq`; -1 when none is left or it ended
int64_t claim(State& s, uint64_t seq) {
  uint64_t w = s.word.load();
  while (seq_of(w) == seq) {
    int64_t chunk;
    const uint64_t next = taken(w, chunk);
    if (chunk < 0) return -1;
    if (s.word.compare_exchange_weak(w, next)) return chunk;
  }
  return -1;
}

// Runs chunk `first` (already claimed) and every further one this thread claims, between enter and leave; the last
// one is reported only after leave, so the job outlives everything this thread does with it
void run_claimed(State& s, Job* job, uint64_t seq, int64_t first, bool worker) {
  bool entered = false;
  try {
    job->enter(job->ctx);
    entered = true;
  } catch (...) {
    note_error(s);
  }
  for (int64_t c = first; c >= 0;) {
    if (entered) {
      try {
        job->run(job->ctx, c);
      } catch (...) {
        note_error(s);
      }
    }
    if (worker) s.worker_chunks.fetch_add(1, std::memory_order_relaxed);
    const int64_t next = claim(s, seq);
    if (next < 0 && entered) {
      try {
        job->leave(job->ctx);
      } catch (...) {
        note_error(s);
      }
    }
    s.done.fetch_add(1);
    c = next;
  }
}

// What a worker finds: true if it took part in a job (or lost a claim and should look again)
bool work(State& s, int index) {
  uint64_t w = s.word.load();
  const uint64_t seq = seq_of(w);
  if (!(seq & 1) || index >= s.helpers.load()) return false;
  int64_t chunk;
  const uint64_t next = taken(w, chunk);  // what is left is in the word itself, read in the one load
  if (chunk < 0) return false;
  if (s.hold.load()) {  // the tests' stand-in for a worker the OS stops right here
    s.holds.fetch_add(1);
    while (s.hold.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!s.word.compare_exchange_strong(w, next)) {
    s.refused_claims.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  run_claimed(s, s.job.load(), seq, chunk, true);
  return true;
}

bool claimable(const State& s, int index) {
  const uint64_t w = s.word.load(std::memory_order_relaxed);
  return (seq_of(w) & 1) && index < s.helpers.load(std::memory_order_relaxed) && front_of(w) < back_of(w);
}

// Checks for work to claim for `ns`, with sched_yield between checks when `yielding`: true once some is found
bool look_for_work(const State& s, int index, int64_t ns, bool yielding) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
  while (std::chrono::steady_clock::now() < until) {
    for (int i = 0; i < 64; ++i) {
      if (claimable(s, index)) return true;
      cpu_relax();
    }
    if (yielding) sched_yield();
  }
  return false;
}

void worker_main(State* s, int index) {
  in_worker = true;
  from_back = true;
  thread_slot = index + 1;
  for (;;) {
    if (work(*s, index)) continue;
    // spin a while: a step's next region comes within microseconds, and waking a sleeper costs more than that.
    // Shorter spins (tried: 5, 20 us) slowed the quiet machine, longer ones (1 ms) the engine beside busy
    // neighbours. Then, if asked (kernel_yield_us), check between sched_yield calls a while before sleeping: beside
    // one busy process it kept the worker off the caller's core, beside four or six it cost more than it gave
    // (docs/measurements.md, "Beside a busy neighbour")
    if (look_for_work(*s, index, s->spin_ns.load(), false) || look_for_work(*s, index, s->yield_ns.load(), true))
      continue;
    s->sleepers.fetch_add(1);
    s->worker_sleeps.fetch_add(1, std::memory_order_relaxed);
    const uint32_t seen = s->wake.load();
    if (!claimable(*s, index)) futex_wait(&s->wake, seen);
    s->sleepers.fetch_sub(1);
  }
}

void start_workers(State& s, int count) {
  std::lock_guard<std::mutex> lock(s.mutex);
  while (static_cast<int>(s.started.size()) < count) {
    std::thread t(worker_main, &s, static_cast<int>(s.started.size()));
    s.started.push_back(t.get_id());
    t.detach();
  }
}

int threads_for_call() {
  static const int cores = usable_cores();
  const int asked = state->threads.load(std::memory_order_relaxed);
  return std::max(1, std::min(cores, asked > 0 ? asked : at::get_num_threads()));
}

void run(int64_t n, Job& job, int threads) {
  if (n <= 0) return;
  TORCH_CHECK(n <= kMaxChunks, "a parallel region takes at most ", kMaxChunks, " chunks, got ", n);
  State& s = *state;
  threads = static_cast<int>(std::min<int64_t>(threads, n));
  const auto t0 = std::chrono::steady_clock::now();
  if (threads <= 1 || in_worker || s.busy.exchange(true)) {  // alone: one thread, a nested call, a second caller
    job.enter(job.ctx);
    for (int64_t c = 0; c < n; ++c) job.run(job.ctx, c);
    job.leave(job.ctx);
    if (!in_worker) {
      s.alone.fetch_add(1, std::memory_order_relaxed);
      s.alone_ns.fetch_add((std::chrono::steady_clock::now() - t0).count(), std::memory_order_relaxed);
    }
    return;
  }
  start_workers(s, threads - 1);
  s.job.store(&job);
  s.helpers.store(threads - 1);
  s.done.store(0);
  const uint64_t seq = (seq_of(s.word.load()) + 1) & 0xFFFFFF;  // odd: live
  s.word.store(job_word(seq, 0, n));
  s.wake.fetch_add(1);
  if (s.sleepers.load() > 0) futex_wake_all(&s.wake);
  const int64_t first = claim(s, seq);
  if (first >= 0) run_claimed(s, &job, seq, first, false);
  // only chunks a worker has claimed are left: wait for those (yielding, in case it is off its core)
  const auto t1 = std::chrono::steady_clock::now();
  const bool waited = s.done.load() < n;
  for (int spins = 0; s.done.load() < n; ++spins) {
    if (spins < 4096) {
      cpu_relax();
    } else {
      sched_yield();
    }
  }
  const auto t2 = std::chrono::steady_clock::now();
  s.regions.fetch_add(1, std::memory_order_relaxed);
  s.region_ns.fetch_add((t2 - t0).count(), std::memory_order_relaxed);
  if (waited) {
    const int64_t w = (t2 - t1).count();
    s.wait_ns.fetch_add(w, std::memory_order_relaxed);
    if (w > 50000) s.waits_50us.fetch_add(1, std::memory_order_relaxed);
    if (w > 1000000) s.waits_1ms.fetch_add(1, std::memory_order_relaxed);
    if (w > s.wait_max_ns.load(std::memory_order_relaxed)) s.wait_max_ns.store(w, std::memory_order_relaxed);
  }
  s.word.store(job_word(seq + 1, 0, 0));  // even: ended; a late claim fails
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    std::swap(error, s.error);
  }
  s.busy.store(false);
  if (error) std::rethrow_exception(error);
}

// each of `chunks` chunks through run(chunk), each taking thread calling enter() before its first and leave() after
// its last (AMX's tile configuration is a thread's)
template <typename E, typename R, typename L>
void parallel_chunks(int64_t chunks, const E& enter, const R& run_chunk, const L& leave) {
  struct Ctx {
    const E* enter;
    const R* run;
    const L* leave;
  } ctx{&enter, &run_chunk, &leave};
  Job job{&ctx, [](void* p, int64_t c) { (*static_cast<Ctx*>(p)->run)(c); },
          [](void* p) { (*static_cast<Ctx*>(p)->enter)(); }, [](void* p) { (*static_cast<Ctx*>(p)->leave)(); }};
  run(chunks, job, threads_for_call());
}

// f(begin, end) over [begin, end) in chunks of `grain` (the last shorter), as at::parallel_for's callable
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  grain = std::max({int64_t{1}, grain, (end - begin + kMaxChunks - 1) / kMaxChunks});
  const auto none = [] {};
  parallel_chunks((end - begin + grain - 1) / grain, none, [&](int64_t c) {
    const int64_t b = begin + c * grain;
    f(b, std::min(end, b + grain));
  }, none);
}

// whether this thread claims from the back of a region's chunks (its next chunk comes before the one it runs)
inline bool claims_from_back() { return from_back; }

// Every fork's child starts without workers
void forget_workers() { state = new State; }
const int registered = pthread_atfork(nullptr, nullptr, forget_workers);
}  // namespace pool

// The kernels' threads: n > 0 sets how many (capped by the cores this process may use), 0 follows
// torch.get_num_threads() of the calling thread, negative leaves it; returns the count a call uses now
int64_t kernel_threads(int64_t n) {
  if (n >= 0) pool::state->threads.store(static_cast<int>(n));
  return pool::threads_for_call();
}

// How long (microseconds) a worker waits for the next job before it sleeps; negative: leave it. Returns it.
int64_t kernel_spin_us(int64_t us) {
  if (us >= 0) pool::state->spin_ns.store(us * 1000);
  return pool::state->spin_ns.load() / 1000;
}

// How long (microseconds) an idle worker goes on checking for work between sched_yield calls after its spin, before
// it sleeps (default 0: it sleeps); negative: leave it. Returns it.
int64_t kernel_yield_us(int64_t us) {
  if (us >= 0) pool::state->yield_ns.store(us * 1000);
  return pool::state->yield_ns.load() / 1000;
}

// The tests' view of the pool: counters, and a hook that stops every worker between reading a job and claiming
std::map<std::string, int64_t> pool_stats() {
  pool::State& s = *pool::state;
  std::lock_guard<std::mutex> lock(s.mutex);
  return {{"workers", static_cast<int64_t>(s.started.size())}, {"worker_chunks", s.worker_chunks.load()},
          {"refused_claims", s.refused_claims.load()}, {"holds", s.holds.load()}, {"hold", s.hold.load()},
          {"threads_set", s.threads.load()}, {"regions", s.regions.load()}, {"alone", s.alone.load()},
          {"region_ns", s.region_ns.load()}, {"alone_ns", s.alone_ns.load()}, {"wait_ns", s.wait_ns.load()},
          {"waits_50us", s.waits_50us.load()}, {"waits_1ms", s.waits_1ms.load()},
          {"wait_max_ns", s.wait_max_ns.exchange(0)}, {"worker_sleeps", s.worker_sleeps.load()}};
}

void pool_hold(bool hold) { pool::state->hold.store(hold ? 1 : 0); }

// [0, items) through parallel_for in chunks of `grain`, each chunk busy ~work_us: how many times each item ran
// (int32 [items]). What the tests check the pool with, beside the kernels themselves.
at::Tensor pool_count(int64_t items, int64_t grain, int64_t work_us) {
  auto counts = at::zeros({items}, at::kInt);
  std::vector<std::atomic<int32_t>> seen(items);
  for (auto& c : seen) c.store(0);
  pool::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) seen[i].fetch_add(1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(work_us);
    while (std::chrono::steady_clock::now() < until) cpu_relax();
  });
  int32_t* cp = counts.data_ptr<int32_t>();
  for (int64_t i = 0; i < items; ++i) cp[i] = seen[i].load();
  return counts;
}

// [0, items) through parallel_for one item a chunk, each busy ~work_us: int64 [items, 2], per item the thread that
// ran it (0 the caller, a worker's index + 1) and its place in the order chunks started
at::Tensor pool_runs(int64_t items, int64_t work_us) {
  auto runs = at::full({items, 2}, -1, at::kLong);
  int64_t* rp = runs.data_ptr<int64_t>();
  std::atomic<int64_t> started{0};
  pool::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      rp[2 * i] = pool::thread_slot;
      rp[2 * i + 1] = started.fetch_add(1);
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(work_us);
    while (std::chrono::steady_clock::now() < until) cpu_relax();
  });
  return runs;
}

// x [T, K] -> (q - 128 as float [T, K], scale [T], zero - 128 [T]): each row over its own [min, max] (widened to
// take in 0) in 255 steps, q = clamp(round(x / scale) + zero, 0, 255), zero = round(-min / scale)
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  check(x, 2, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  auto out = at::empty({rows, cols}, x.options());
  auto scale = at::empty({rows}, x.options());
  auto shifted = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = scale.data_ptr<float>();
  float* zp = shifted.data_ptr<float>();
  pool::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * cols;
      float low = 0.f, high = 0.f;
      for (int64_t k = 0; k < cols; ++k) {
        low = std::min(low, row[k]);
        high = std::max(high, row[k]);
      }
      const float s = std::max((high - low) / kLevels, kTiny);
      const float zero = std::nearbyint(-low / s);
      float* o = op + t * cols;
      for (int64_t k = 0; k < cols; ++k) {
        const float q = std::nearbyint(row[k] / s) + zero;
        o[k] = std::min(std::max(q, 0.f), kLevels) - kMid;
      }
      sp[t] = s;
      zp[t] = zero - kMid;
    }
  });
  return {out, scale, shifted};
}

// y [T, N] in place: (y - shifted[t] * unit[n]) * scale[t], unit being what one zero-point step adds to output n
at::Tensor dequantize_rows(at::Tensor y, const at::Tensor& scale, const at::Tensor& shifted, const at::Tensor& unit) {
  check(y, 2, "y");
  check(scale, 1, "scale");
  check(shifted, 1, "shifted");
  check(unit, 1, "unit");
  const int64_t rows = y.size(0), cols = y.size(1);
  TORCH_CHECK(scale.size(0) == rows && shifted.size(0) == rows && unit.size(0) == cols, "shapes do not match");
  float* yp = y.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = shifted.data_ptr<float>();
  const float* up = unit.data_ptr<float>();
  pool::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = yp + t * cols;
      const float s = sp[t], z = zp[t];
      for (int64_t n = 0; n < cols; ++n) {
        const float correction = z * up[n];
        r[n] = (r[n] - correction) * s;
      }
    }
  });
  return y;
}

namespace {
// e^x, to about 2 ulp over the whole float range (Cephes' expf: 2^n times a degree-7 polynomial on
// [-ln2/2, ln2/2]), written so that a loop of it vectorizes: std::exp is a scalar call per element, and over the
// scores of a decode step it took most of the attention's time. Below -87 it returns about 2^-126, not 0; above 88,
// e^88.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, built in the exponent field
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// sum of a[j], vectorized as dot is
inline float lane_sum(const float* a, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += a[j];
  return sum;
}

// sum of a[d] * b[d]: OpenMP's simd reduction keeps partial sums in vector lanes (a float sum in one chain would
// not vectorize without licence to reorder it)
inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// One query head against the n keys of its KV head, and the weighted sum of their values. A key or value of slot j
// starts at at[j] * dim of the pool; an int8 pool's element is q * its slot's scale. Two versions: these portable
// loops, and AVX-512 for head sizes of 16-128 (heads_avx512: C vectors of 16 floats, a whole grouped-query group at
// once), whose queries and sums stay in registers (the portable loops spend most of their time adding a dot
// product's lanes one by one and moving sums through memory).
template <typename P>
void scores_portable(const float* query, const P* kp, const int64_t* at, int64_t n, int64_t dim,
                     const float* k_scale, float* s) {
  std::vector<float> key_f(dim);
  for (int64_t j = 0; j < n; ++j) {
    const P* key = kp + at[j] * dim;
    if constexpr (std::is_same_v<P, float>) {
      s[j] = dot(query, key, dim);
    } else {
      for (int64_t d = 0; d < dim; ++d) key_f[d] = static_cast<float>(key[d]);
      s[j] = dot(query, key_f.data(), dim) * (std::is_same_v<P, int8_t> ? k_scale[at[j]] : 1.f);
    }
  }
}

template <typename P>
void values_portable(const float* weight, const P* vp, const int64_t* at, int64_t n, int64_t dim,
                     const float* v_scale, float* acc) {
  std::fill(acc, acc + dim, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const P* value = vp + at[j] * dim;
    const float p = weight[j] * (std::is_same_v<P, int8_t> ? v_scale[at[j]] : 1.f);
    for (int64_t d = 0; d < dim; ++d) acc[d] += p * static_cast<float>(value[d]);
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of a float
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

#endif

#if defined(__AVX512F__)
// fast_exp on 16 lanes, operation for operation (no fused multiply-adds, as the scalar one is built): the same floats
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// s[0, n) -> exp(s - max s) in place; returns 1 / their sum
inline float softmax_in_place(float* s, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  __m512 top = lowest;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1u);
  if (j < n) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(lowest, tail, s + j));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < n) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(m, tail, s + j), m));
    _mm512_mask_storeu_ps(s + j, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// Slots are scattered over the pool (a block's 16, then another block's), one KV head's part of a slot a strided
// 32-256 bytes: too little in a row for the hardware's prefetchers, so a row's keys and values were read at a
// fraction of the memory's speed (measured: docs/measurements.md). The score pass asks for the K and V of the key
// this many ahead.
constexpr int64_t ATTENTION_PREFETCH = 12;
inline void prefetch_lines(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

#if defined(__AVX512BF16__)
// 16 vectors' lane sums, in order, as one vector: a transpose-and-add in ~3 operations a vector, where a reduction
// of each (_mm512_reduce_add_ps) takes ~9
inline __m512 lane_sums16(const __m512* v) {
  __m512 u[4];  // u[g]'s 128-bit lane l: the sums of lane l of v[4g], v[4g + 1], v[4g + 2], v[4g + 3]
  for (int g = 0; g < 4; ++g) {
    const __m512* w = v + 4 * g;
    const __m512d t0 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1])));
    const __m512d t1 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3])));
    u[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(t0, t1)), _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t1)));
  }
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
}

// The scores of GB heads against n keys of a bf16 pool with AVX-512 BF16's dot products: the query as it came (bf16,
// unscaled: exact), each pair of products exact and summed in float (denormals as zero), times scale after. 16
// keys a time, their sums transposed into one vector (lane_sums16); the first head's pass asks for the K and V some
// keys ahead. qb: GB rows of 16 * C bf16 (C even); s: GB rows of n.
template <int C, int GB>
void scores_bf16(const c10::BFloat16* qb, float scale, const c10::BFloat16* kp, const c10::BFloat16* vp,
                 const int64_t* at, int64_t n, float* s) {
  constexpr int Z = C / 2;  // a key's vectors of 32 bf16
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int h = 0; h < GB; ++h) {
    __m512bh q[Z];
    for (int z = 0; z < Z; ++z) q[z] = (__m512bh)_mm512_loadu_si512(qb + h * 16 * C + 32 * z);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, n - j0));
      if (h == 0) {  // the next group's K and V, for this pass and the values'
        for (int64_t j = j0 + 16; j < std::min<int64_t>(j0 + 32, n); ++j) {
          prefetch_lines(kp + at[j] * (16 * C), 16 * C * sizeof(c10::BFloat16));
          prefetch_lines(vp + at[j] * (16 * C), 16 * C * sizeof(c10::BFloat16));
        }
      }
      __m512 acc[16];
      if (m == 16) {  // a whole group, without the partial one's test a key: one loop for both took 10-20% longer
        for (int jj = 0; jj < 16; ++jj) {
          const c10::BFloat16* key = kp + at[j0 + jj] * (16 * C);
          acc[jj] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(key));
          for (int z = 1; z < Z; ++z)
            acc[jj] = _mm512_dpbf16_ps(acc[jj], q[z], (__m512bh)_mm512_loadu_si512(key + 32 * z));
        }
      } else {
        for (int jj = 0; jj < 16; ++jj) {
          acc[jj] = _mm512_setzero_ps();
          if (jj >= m) continue;
          const c10::BFloat16* key = kp + at[j0 + jj] * (16 * C);
          for (int z = 0; z < Z; ++z)
            acc[jj] = _mm512_dpbf16_ps(acc[jj], q[z], (__m512bh)_mm512_loadu_si512(key + 32 * z));
        }
      }
      _mm512_mask_storeu_ps(s + h * n + j0, static_cast<__mmask16>((1u << m) - 1u),
                            _mm512_mul_ps(lane_sums16(acc), scaled));
    }
  }
}
#endif

// heads_avx512's scores in float: each key loaded (and widened) once for the GB heads, a reduction per head
template <int C, int GB, typename P>
void scores_avx512(const float* query, const P* kp, const P* vp, const int64_t* at, int64_t n, const float* k_scale,
                   float* s) {
  __m512 qv[GB][C];
  for (int h = 0; h < GB; ++h)
    for (int c = 0; c < C; ++c) qv[h][c] = _mm512_loadu_ps(query + h * 16 * C + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    if (j + ATTENTION_PREFETCH < n) {  // this key's K and V some keys ahead, for this pass and the values' pass
      prefetch_lines(kp + at[j + ATTENTION_PREFETCH] * (16 * C), 16 * C * sizeof(P));
      prefetch_lines(vp + at[j + ATTENTION_PREFETCH] * (16 * C), 16 * C * sizeof(P));
    }
    const P* key = kp + at[j] * (16 * C);
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load16(key + 16 * c);
    const float ks = std::is_same_v<P, int8_t> ? k_scale[at[j]] : 1.f;
    for (int h = 0; h < GB; ++h) {
      __m512 sum = _mm512_mul_ps(qv[h][0], kv[0]);
      for (int c = 1; c < C; ++c) sum = _mm512_fmadd_ps(qv[h][c], kv[c], sum);
      s[h * n + j] = _mm512_reduce_add_ps(sum) * ks;
    }
  }
}

// heads_avx512's softmax of the scores s and the weighted sums of the values
template <int C, int GB, typename P>
void values_avx512(const P* kp, const P* vp, const int64_t* at, int64_t n, const float* v_scale, float* s,
                   float* out) {
  float inv[GB];
  for (int h = 0; h < GB; ++h) inv[h] = softmax_in_place(s + h * n, n);
  __m512 acc[GB][C];
  for (int h = 0; h < GB; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const P* value = vp + at[j] * (16 * C);
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(value + 16 * c);
    const float vs = std::is_same_v<P, int8_t> ? v_scale[at[j]] : 1.f;
    for (int h = 0; h < GB; ++h) {
      const __m512 p = _mm512_set1_ps(s[h * n + j] * vs);
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(p, vv[c], acc[h][c]);
    }
  }
  for (int h = 0; h < GB; ++h)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(out + h * 16 * C + 16 * c, _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inv[h])));
}

// GB query heads of one KV head (a grouped-query group, or part of one) against its n keys, and the weighted sums of
// its values: each key and value is loaded (and widened from bf16 or int8) once for all GB heads, not once per head,
// and the scores' exponentials are taken 16 at a time. query: GB rows of 16 * C floats (already scaled); s: GB * n
// scratch; out: GB rows of 16 * C floats. Per head: a dot product in 16 lanes, one fused multiply-add a vector.
// qb (a bf16 pool, C even, AVX-512 BF16): the same GB heads as they came, in bf16, scored by scores_bf16 instead.
template <int C, int GB, typename P>
void heads_avx512(const float* query, const P* kp, const P* vp, const int64_t* at, int64_t n, const float* k_scale,
                  const float* v_scale, float* s, float* out, const c10::BFloat16* qb, float scale) {
  bool scored = false;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<P, c10::BFloat16> && C % 2 == 0) {
    if (qb != nullptr) {
      scores_bf16<C, GB>(qb, scale, kp, vp, at, n, s);
      scored = true;
    }
  }
#endif
  if (!scored) scores_avx512<C, GB>(query, kp, vp, at, n, k_scale, s);
  values_avx512<C, GB>(kp, vp, at, n, v_scale, s, out);
}

// calls run(std::integral_constant<int, C>) with C = dim / 16 where the AVX-512 loops take that head size (16-128);
// false where they do not
template <typename F>
bool with_vectors(int64_t dim, F&& run) {
  switch (dim) {
    case 16: run(std::integral_constant<int, 1>{}); return true;
    case 32: run(std::integral_constant<int, 2>{}); return true;
    case 64: run(std::integral_constant<int, 4>{}); return true;
    case 128: run(std::integral_constant<int, 8>{}); return true;
    default: return false;
  }
}

// heads_avx512 for `heads` query heads (any number), in chunks of up to 4; false where dim is not 16-128
template <typename P>
bool heads_vectorized(const float* query, int64_t heads, int64_t dim, const P* kp, const P* vp, const int64_t* at,
                      int64_t n, const float* k_scale, const float* v_scale, float* s, float* out,
                      const c10::BFloat16* qb, float scale) {
  auto chunks = [&](auto c) {
    constexpr int C = decltype(c)::value;
    for (int64_t h = 0; h < heads;) {
      const int64_t take = std::min<int64_t>(4, heads - h);
      const float* qh = query + h * dim;
      const c10::BFloat16* qbh = qb == nullptr ? nullptr : qb + h * dim;
      float* oh = out + h * dim;
      switch (take) {
        case 4: heads_avx512<C, 4>(qh, kp, vp, at, n, k_scale, v_scale, s, oh, qbh, scale); break;
        case 3: heads_avx512<C, 3>(qh, kp, vp, at, n, k_scale, v_scale, s, oh, qbh, scale); break;
        case 2: heads_avx512<C, 2>(qh, kp, vp, at, n, k_scale, v_scale, s, oh, qbh, scale); break;
        default: heads_avx512<C, 1>(qh, kp, vp, at, n, k_scale, v_scale, s, oh, qbh, scale); break;
      }
      h += take;
    }
  };
  return with_vectors(dim, chunks);
}
#endif

// the portable loops: head sizes the AVX-512 ones do not take (heads_vectorized), and builds without AVX-512
template <typename P>
void scores(const float* query, const P* kp, const int64_t* at, int64_t n, int64_t dim, const float* k_scale,
            float* s) {
  scores_portable(query, kp, at, n, dim, k_scale, s);
}

template <typename P>
void weighted_values(const float* weight, const P* vp, const int64_t* at, int64_t n, int64_t dim,
                     const float* v_scale, float* out) {
  values_portable(weight, vp, at, n, dim, v_scale, out);
}

// T: q's and the output's dtype; P: the pool's (T, or int8 with a float scale per slot and KV head, k_scale and
// v_scale [slots, KV], each element read as q * scale)
// One call of decode_attention below, its tensors checked, as pointers: q [rows, heads, dim] (row and head strides
// q_row, q_head) and the output [rows, heads * dim] of q_type; the pools [slots, kv_heads, dim] (int8 with k_scale
// and v_scale, or q_type); slot lists [*, width], lens [rows] and lists [rows] or null
struct Attention {
  at::ScalarType q_type;
  const void* q;
  int64_t q_row, q_head, rows, heads, dim, kv_heads;
  const void *k, *v;
  const float *k_scale, *v_scale;
  const int64_t *slots, *lens, *lists;
  int64_t width;
  void* out;
};

template <typename T, typename P>
void decode_attention_rows(const Attention& a) {
  const int64_t rows = a.rows, heads = a.heads, dim = a.dim, kv_heads = a.kv_heads;
  const int64_t group = heads / kv_heads, width = a.width, qs_row = a.q_row, qs_head = a.q_head;
  const T* qp = static_cast<const T*>(a.q);
  const P* kp = static_cast<const P*>(a.k);
  const P* vp = static_cast<const P*>(a.v);
  const int64_t *sp = a.slots, *lp = a.lens, *lists = a.lists;
  const float *k_scale = a.k_scale, *v_scale = a.v_scale;
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  T* op = static_cast<T*>(a.out);
  const int64_t longest = rows > 0 ? *std::max_element(lp, lp + rows) : 0;
  auto attend = [&](int64_t begin, int64_t end) {  // tasks [begin, end): task i is row i / KV, KV head i % KV
    float* query = scratch<float, Use::kQuery>(group * dim);
    float* acc = scratch<float, Use::kAcc>(group * dim);
    float* s = scratch<float, Use::kScores>(std::min<int64_t>(group, 4) * longest);
#if defined(__AVX512BF16__)
    constexpr bool bf16_scores = std::is_same_v<T, c10::BFloat16> && std::is_same_v<P, c10::BFloat16>;
#else
    constexpr bool bf16_scores = false;
#endif
    // the group's queries as they came (scores_bf16)
    c10::BFloat16* qb = bf16_scores ? scratch<c10::BFloat16, Use::kQueryBf16>(group * dim) : nullptr;
    int64_t* at = scratch<int64_t, Use::kAt>(longest);  // where each slot's K (and V) of this KV head starts, in dims
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / kv_heads, kvh = i % kv_heads, n = lp[row];
      const int64_t* row_slots = sp + (lists == nullptr ? row : lists[row]) * width;
      for (int64_t j = 0; j < n; ++j) at[j] = row_slots[j] * kv_heads + kvh;
#if defined(__AVX512F__)
      {  // the whole group at once, where the head size has the vector loops (heads_vectorized)
        for (int64_t h = 0; h < group; ++h) {
          const T* src = qp + row * qs_row + (kvh * group + h) * qs_head;
          for (int64_t d = 0; d < dim; ++d) query[h * dim + d] = static_cast<float>(src[d]) * scale;
          if constexpr (bf16_scores) std::copy(src, src + dim, qb + h * dim);
        }
        if (heads_vectorized(query, group, dim, kp, vp, at, n, k_scale, v_scale, s, acc, qb, scale)) {
          T* dst = op + (row * heads + kvh * group) * dim;
          for (int64_t d = 0; d < group * dim; ++d) dst[d] = static_cast<T>(acc[d]);
          continue;
        }
      }
#endif
      for (int64_t h = 0; h < group; ++h) {
        const T* src = qp + row * qs_row + (kvh * group + h) * qs_head;
        for (int64_t d = 0; d < dim; ++d) query[d] = static_cast<float>(src[d]) * scale;
        scores(query, kp, at, n, dim, k_scale, s);
        float top = -INFINITY;
        for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j]);
        for (int64_t j = 0; j < n; ++j) s[j] = fast_exp(s[j] - top);
        const float inv = 1.f / lane_sum(s, n);
        weighted_values(s, vp, at, n, dim, v_scale, acc);
        T* dst = op + (row * heads + kvh * group + h) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
      }
    }
  };
  // parts of equal work, not of equal task counts: a task costs about its row's context (a prefill chunk's rows read
  // 1, 2, ... slots, a decode row hundreds), so equal counts left one thread waiting on the other. Four parts a
  // thread: a part some thread has claimed is all the caller can be left waiting for
  const int64_t tasks = rows * kv_heads;
  int64_t* cost = scratch<int64_t, Use::kCost>(tasks + 1);  // cost[i]: that of tasks [0, i)
  cost[0] = 0;
  for (int64_t i = 0; i < tasks; ++i) cost[i + 1] = cost[i] + lp[i / kv_heads] + 16;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(4 * pool::threads_for_call(), tasks));
  auto first_task = [&](int64_t part) {  // where part `part` of `parts` starts
    if (part >= parts) return tasks;
    return static_cast<int64_t>(std::lower_bound(cost, cost + tasks + 1, cost[tasks] * part / parts) - cost);
  };
  pool::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) { attend(first_task(begin), first_task(end)); });
}

void attend(const Attention& a) {
  const bool int8_pool = a.k_scale != nullptr;
  if (a.q_type == at::kFloat) {
    int8_pool ? decode_attention_rows<float, int8_t>(a) : decode_attention_rows<float, float>(a);
  } else {
    int8_pool ? decode_attention_rows<c10::BFloat16, int8_t>(a) : decode_attention_rows<c10::BFloat16, c10::BFloat16>(a);
  }
}
}  // namespace

namespace {
// slots [rows, W] (or [S, W] with lists [rows]) and lens [rows], int64: the slot list each row reads and how many of
// its slots (1..W). Returns lists' data, or null without. Plain loops: torch's min / max cost more than the kernel
const int64_t* check_slot_lists(const at::Tensor& slots, const at::Tensor& lens,
                                const c10::optional<at::Tensor>& lists, int64_t rows) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.is_contiguous() &&
                  (lists.has_value() || slots.size(0) == rows) && lens.scalar_type() == at::kLong &&
                  lens.dim() == 1 && lens.is_contiguous() && lens.size(0) == rows,
              "slots [B, W] (or [S, W] with lists) and lens [B] must be int64");
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    TORCH_CHECK(lp[row] >= 1 && lp[row] <= slots.size(1), "each row needs 1..W context slots");
  }
  if (!lists.has_value()) return nullptr;
  TORCH_CHECK(lists->scalar_type() == at::kLong && lists->dim() == 1 && lists->is_contiguous() &&
                  lists->size(0) == rows,
              "lists must be int64 [B]");
  const int64_t* listp = lists->data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    TORCH_CHECK(listp[row] >= 0 && listp[row] < slots.size(0), "a row's list is past slots' ", slots.size(0));
  }
  return listp;
}

// an int64 [rows] tensor of indices each in [0, end): a step's slots in the pool, or its positions in the RoPE tables
const int64_t* check_indices(const at::Tensor& t, int64_t rows, int64_t end, const char* what, const char* past) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() && t.size(0) == rows, what,
              " must be int64 [T]");
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) TORCH_CHECK(p[i] >= 0 && p[i] < end, past, " (", p[i], " of ", end, ")");
  return p;
}
}  // namespace

// the K and V pools [slots, KV, D]: contiguous CPU tensors of one shape, in dtype (`whose`, in the message) or int8,
// with kv KV heads (any where kv < 0) and head size dim; an int8 pool comes with float32 scales [slots, KV] for its
// K and its V, and only an int8 pool does
void check_pools(const at::Tensor& k, const at::Tensor& v, int64_t kv, int64_t dim, at::ScalarType dtype,
                 const char* whose, const c10::optional<at::Tensor>& k_scale,
                 const c10::optional<at::Tensor>& v_scale) {
  const bool int8_pool = k.scalar_type() == at::kChar;
  TORCH_CHECK(k.device().is_cpu() && k.dim() == 3 && k.is_contiguous() && v.sizes() == k.sizes() &&
                  v.is_contiguous() && v.scalar_type() == k.scalar_type() && (int8_pool || k.scalar_type() == dtype) &&
                  (kv < 0 || k.size(1) == kv) && k.size(2) == dim,
              "the K and V pools must be contiguous pools [slots, KV, D] of one shape, in ", whose, " or int8 (",
              dtype, ")");
  TORCH_CHECK(int8_pool == (k_scale.has_value() && v_scale.has_value()), "an int8 pool, and only one, has scales");
  if (!int8_pool) return;
  for (const auto& t : {*k_scale, *v_scale}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == k.size(0) &&
                    t.size(1) == k.size(1),
                "an int8 pool's scales must be contiguous float32 [slots, KV]");
  }
}

// q [B, H, D] (any row and head strides, D contiguous), k and v [slots, KV, D] the pool, slots [S, W] slot lists,
// lens [B]: row b reads the first lens[b] slots of list lists[b] (of list b without `lists` [B]) -> [B, H * D]:
// softmax(q.k / sqrt(D)) . v per row and head, a query head reading KV head h / (H / KV) (grouped-query attention).
// A decode row reads its request's whole context; the rows of a prefill chunk share their request's list, each
// reading up to its own position (causal), so one call attends a whole step. An int8 pool comes with k_scale and
// v_scale [slots, KV] (float32), and is read as q * scale.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                            const at::Tensor& lens, const c10::optional<at::Tensor>& k_scale,
                            const c10::optional<at::Tensor>& v_scale, const c10::optional<at::Tensor>& lists) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, "q must be a CPU tensor [B, H, D]");
  const bool int8_pool = k.scalar_type() == at::kChar;
  check_pools(k, v, -1, q.size(2), q.scalar_type(), "q's dtype", k_scale, v_scale);
  const float* ks = int8_pool ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = int8_pool ? v_scale->data_ptr<float>() : nullptr;
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of KV heads");
  const int64_t* listp = check_slot_lists(slots, lens, lists, q.size(0));
  TORCH_CHECK(float_or_bf16(q), "decode_attention takes float32 or bfloat16");
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  attend({q.scalar_type(), q.data_ptr(), q.stride(0), q.stride(1), q.size(0), q.size(1), q.size(2), k.size(1),
          k.data_ptr(), v.data_ptr(), ks, vs, slots.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), listp, slots.size(1),
          out.data_ptr()});
  return out;
}

// ---- A decoder layer's elementwise steps, one call each (models/llama.py). As torch calls, an RMSNorm is seven
// operations, RoPE six and the MLP's activation four, each a few microseconds of dispatch for the one row of a
// batch-1 step: about 40% of an int4 token's time. Each rounds where transformers' formula rounds (to the model's
// dtype after each operation; products and sums are not fused), so they differ from it only in the order of a row's
// sum of squares and in exp's last bits: float rounding, as a different matmul kernel would.
namespace {
constexpr int64_t kRowsPerNormTask = 8;

template <typename O>
inline O round_to(float value) {
  return static_cast<O>(value);  // float -> float is nothing; float -> bf16 rounds to nearest even, as torch does
}

#if defined(__AVX512F__)
// round_to on 16 lanes: bf16's bits (round to nearest even, NaN to 0x7fc0: c10::BFloat16's own conversion) in the
// low half of each lane; round16<O> the float they stand for; store16 writes 16 results as O
inline __m512i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, bias), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

template <typename O>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<O, float>) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
  }
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// store16(p, round16<M>(v)), rounding once where once is the same: to M then to O is to O alone when M is O (a
// rounded value rounds to itself, NaN to the same 0x7fc0) or float (no rounding); a bf16 row saves a third of its work
template <typename M, typename O>
inline void store16_as(O* p, __m512 v) {
  if constexpr (std::is_same_v<M, O> || std::is_same_v<M, float>) {
    store16(p, v);
  } else {
    store16(p, round16<M>(v));
  }
}
#endif

template <typename X, typename R, typename H>
void add_rms_norm_rows(X* xp, const R* rp, const X* wp, H* hp, int64_t rows, int64_t cols, float eps) {
  pool::parallel_for(0, rows, kRowsPerNormTask, [&](int64_t begin, int64_t end) {
    float* xf = scratch<float, Use::kNormRow>(cols);
    for (int64_t t = begin; t < end; ++t) {
      X* x = xp + t * cols;
      int64_t k0 = 0;  // where the scalar loops take over from the 16-lane ones (the same floats)
      if (rp != nullptr) {
        const R* r = rp + t * cols;
#if defined(__AVX512F__)
        for (; k0 + 16 <= cols; k0 += 16) store16_as<X>(x + k0, _mm512_add_ps(load16(x + k0), load16(r + k0)));
#endif
        for (int64_t k = k0; k < cols; ++k) x[k] = round_to<X>(static_cast<float>(x[k]) + static_cast<float>(r[k]));
      }
      for (int64_t k = 0; k < cols; ++k) xf[k] = static_cast<float>(x[k]);
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t k = 0; k < cols; ++k) squares += xf[k] * xf[k];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(cols) + eps);
      H* h = hp + t * cols;
      k0 = 0;
#if defined(__AVX512F__)
      for (const __m512 by = _mm512_set1_ps(inv); k0 + 16 <= cols; k0 += 16) {
        const __m512 normed = round16<X>(_mm512_mul_ps(_mm512_loadu_ps(xf + k0), by));
        store16_as<X>(h + k0, _mm512_mul_ps(load16(wp + k0), normed));
      }
#endif
      for (int64_t k = k0; k < cols; ++k) {
        const float normed = static_cast<float>(round_to<X>(xf[k] * inv));
        h[k] = round_to<H>(static_cast<float>(round_to<X>(static_cast<float>(wp[k]) * normed)));
      }
    }
  });
}

// add_rms_norm below over pointers: x [rows, cols] of x_type (added to in place), the residual of r_type (Undefined:
// none), weight of x_type, h of h_type (x_type, or bf16)
void add_rms_norm_into(at::ScalarType x_type, void* x, at::ScalarType r_type, const void* r, const void* w,
                       at::ScalarType h_type, void* h, int64_t rows, int64_t cols, float eps) {
  using B = c10::BFloat16;
  const bool bf16_residual = r_type == at::kBFloat16, has_residual = r_type != at::ScalarType::Undefined;
  if (x_type == at::kBFloat16) {
    add_rms_norm_rows<B, B, B>(static_cast<B*>(x), has_residual ? static_cast<const B*>(r) : nullptr,
                               static_cast<const B*>(w), static_cast<B*>(h), rows, cols, eps);
    return;
  }
  float* xf = static_cast<float*>(x);
  const float* wf = static_cast<const float*>(w);
  const float* rf = has_residual && !bf16_residual ? static_cast<const float*>(r) : nullptr;
  const B* rb = bf16_residual ? static_cast<const B*>(r) : nullptr;
  if (h_type == at::kFloat && !bf16_residual) {
    add_rms_norm_rows<float, float, float>(xf, rf, wf, static_cast<float*>(h), rows, cols, eps);
  } else if (h_type == at::kFloat) {
    add_rms_norm_rows<float, B, float>(xf, rb, wf, static_cast<float*>(h), rows, cols, eps);
  } else if (!bf16_residual) {
    add_rms_norm_rows<float, float, B>(xf, rf, wf, static_cast<B*>(h), rows, cols, eps);
  } else {
    add_rms_norm_rows<float, B, B>(xf, rb, wf, static_cast<B*>(h), rows, cols, eps);
  }
}

template <typename X, typename C, typename O>
void rope_rows(const X* xp, int64_t row_stride, int64_t head_stride, const C* cp, const C* sp, const int64_t* pos,
               O* op, int64_t rows, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  pool::parallel_for(0, rows, kRowsPerNormTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const C* cos = cp + pos[t] * dim;
      const C* sin = sp + pos[t] * dim;  // minus sign on the first half (rotate_half's)
      for (int64_t h = 0; h < heads; ++h) {
        const X* x = xp + t * row_stride + h * head_stride;
        O* o = op + (t * heads + h) * dim;
        int64_t d0 = 0;
#if defined(__AVX512F__)
        if (half % 16 == 0) {  // 16 lanes never straddle the halves
          for (; d0 < dim; d0 += 16) {
            const __m512 straight = round16<O>(_mm512_mul_ps(load16(x + d0), load16(cos + d0)));
            const __m512 turned = round16<O>(_mm512_mul_ps(load16(x + (d0 < half ? d0 + half : d0 - half)),
                                                           load16(sin + d0)));
            store16_as<O>(o + d0, _mm512_add_ps(straight, turned));
          }
        }
#endif
        for (int64_t d = d0; d < dim; ++d) {
          const float straight = static_cast<float>(round_to<O>(static_cast<float>(x[d]) * static_cast<float>(cos[d])));
          const float rotated = static_cast<float>(x[d < half ? d + half : d - half]);
          const float turned = static_cast<float>(round_to<O>(rotated * static_cast<float>(sin[d])));
          o[d] = round_to<O>(straight + turned);
        }
      }
    }
  });
}

// rope below over pointers: qk of qk_type (row and head strides), tables of table_type; out [rows, heads, dim] in
// bf16 where the tables are, else float32
void rope_into(at::ScalarType qk_type, const void* qk, int64_t row_stride, int64_t head_stride, at::ScalarType table_type,
               const void* cos, const void* sin, const int64_t* pos, void* out, int64_t rows, int64_t heads,
               int64_t dim) {
  using B = c10::BFloat16;
  if (qk_type == at::kFloat) {
    rope_rows<float, float, float>(static_cast<const float*>(qk), row_stride, head_stride,
                                   static_cast<const float*>(cos), static_cast<const float*>(sin), pos,
                                   static_cast<float*>(out), rows, heads, dim);
  } else if (table_type == at::kFloat) {
    rope_rows<B, float, float>(static_cast<const B*>(qk), row_stride, head_stride, static_cast<const float*>(cos),
                               static_cast<const float*>(sin), pos, static_cast<float*>(out), rows, heads, dim);
  } else {
    rope_rows<B, B, B>(static_cast<const B*>(qk), row_stride, head_stride, static_cast<const B*>(cos),
                       static_cast<const B*>(sin), pos, static_cast<B*>(out), rows, heads, dim);
  }
}

template <typename X, typename M, typename O>
void silu_mul_rows(const X* gp, O* op, int64_t rows, int64_t inter) {
  pool::parallel_for(0, rows, kRowsPerNormTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const X* g = gp + t * 2 * inter;
      const X* u = g + inter;
      O* o = op + t * inter;
      int64_t k0 = 0;
#if defined(__AVX512F__)
      for (const __m512 one = _mm512_set1_ps(1.f); k0 + 16 <= inter; k0 += 16) {
        const __m512 x = load16(g + k0);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 activated = round16<M>(_mm512_div_ps(x, _mm512_add_ps(one, e)));
        store16_as<M>(o + k0, _mm512_mul_ps(activated, load16(u + k0)));
      }
#endif
      for (int64_t k = k0; k < inter; ++k) {
        const float x = static_cast<float>(g[k]);
        const float activated = static_cast<float>(round_to<M>(x / (1.f + fast_exp(-x))));
        o[k] = round_to<O>(static_cast<float>(round_to<M>(activated * static_cast<float>(u[k]))));
      }
    }
  });
}
// silu_mul below over pointers: gate_up [rows, 2 * inter] of in_type, computed in dtype, out of result
void silu_mul_into(at::ScalarType in_type, const void* gate_up, at::ScalarType dtype, at::ScalarType result, void* out,
                   int64_t rows, int64_t inter) {
  using B = c10::BFloat16;
  const bool bf16_in = in_type == at::kBFloat16;
  if (dtype == at::kBFloat16) {
    silu_mul_rows<B, B, B>(static_cast<const B*>(gate_up), static_cast<B*>(out), rows, inter);
  } else if (!bf16_in && result == at::kFloat) {
    silu_mul_rows<float, float, float>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter);
  } else if (!bf16_in) {
    silu_mul_rows<float, float, B>(static_cast<const float*>(gate_up), static_cast<B*>(out), rows, inter);
  } else if (result == at::kFloat) {
    silu_mul_rows<B, float, float>(static_cast<const B*>(gate_up), static_cast<float*>(out), rows, inter);
  } else {
    silu_mul_rows<B, float, B>(static_cast<const B*>(gate_up), static_cast<B*>(out), rows, inter);
  }
}
}  // namespace

// x [T, K] (float32 or bf16, contiguous) += residual [T, K] in place when given (float32 or bf16), then its RMSNorm
// times weight [K] (x's dtype): transformers' `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`, in fp32 inside;
// returned in x's dtype, or cast on to bf16 from a float32 x (what the next projection's kernel takes: the same
// floats as a cast after)
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                        double eps, c10::optional<at::ScalarType> dtype) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && float_or_bf16(x),
              "x must be a contiguous float32 or bfloat16 CPU tensor [T, K]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous(),
              "weight must be [K] in x's dtype");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() && float_or_bf16(*residual),
                "residual must be a contiguous float32 or bfloat16 tensor shaped as x");
  }
  const at::ScalarType out_dtype = dtype.value_or(x.scalar_type());
  TORCH_CHECK(out_dtype == x.scalar_type() || out_dtype == at::kBFloat16, "the norm returns x's dtype or bfloat16");
  TORCH_CHECK(x.scalar_type() == at::kFloat || !residual.has_value() || residual->scalar_type() == at::kBFloat16,
              "a bfloat16 x takes a bfloat16 residual");
  auto h = at::empty(x.sizes(), x.options().dtype(out_dtype));
  // (an empty tensor's data pointer is null: the dtypes, not the pointers, choose)
  add_rms_norm_into(x.scalar_type(), x.data_ptr(), residual ? residual->scalar_type() : at::ScalarType::Undefined,
                    residual ? residual->data_ptr() : nullptr, weight.data_ptr(), out_dtype, h.data_ptr(), x.size(0),
                    x.size(1), static_cast<float>(eps));
  return h;
}

// qk [T, H, D] (any row and head strides, D contiguous), cos and signed_sin [L, D] the model's tables (sin negated on
// the first half), positions [T] -> [T, H, D]: qk * cos + rotate_half(qk) * sin, in float32 unless both are bf16
at::Tensor rope(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& signed_sin,
                const at::Tensor& positions) {
  TORCH_CHECK(qk.device().is_cpu() && qk.dim() == 3 && qk.stride(2) == 1 && float_or_bf16(qk) &&
                  qk.size(2) % 2 == 0,
              "qk must be a float32 or bfloat16 CPU tensor [T, H, D], D even and contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && signed_sin.sizes() == cos.sizes() &&
                  signed_sin.is_contiguous() && signed_sin.scalar_type() == cos.scalar_type() &&
                  cos.size(1) == qk.size(2) && float_or_bf16(cos),
              "cos and signed_sin must be contiguous [L, D] tables of one dtype");
  const int64_t rows = qk.size(0), heads = qk.size(1), dim = qk.size(2);
  const int64_t* pos = check_indices(positions, rows, cos.size(0), "positions", "a position is past the table");
  const bool bf16_in = qk.scalar_type() == at::kBFloat16, bf16_table = cos.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!bf16_table || bf16_in, "bfloat16 tables take bfloat16 qk");
  auto out = at::empty({rows, heads, dim}, qk.options().dtype(bf16_table ? at::kBFloat16 : at::kFloat));
  rope_into(qk.scalar_type(), qk.data_ptr(), qk.stride(0), qk.stride(1), cos.scalar_type(), cos.data_ptr(),
            signed_sin.data_ptr(), pos, out.data_ptr(), rows, heads, dim);
  return out;
}

// gate_up [T, 2I] (gate | up, contiguous) -> silu(gate) * up [T, I] computed in dtype (the model's: float32, or
// bf16 from a bf16 gate_up), silu's result rounded to it first as transformers' is; returned in dtype, or cast on to
// out_dtype (bf16 from float32: what the down projection's kernel takes)
at::Tensor silu_mul(const at::Tensor& gate_up, at::ScalarType dtype, c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.is_contiguous() && float_or_bf16(gate_up) &&
                  gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous float32 or bfloat16 CPU tensor [T, 2I]");
  TORCH_CHECK(dtype == at::kFloat || (dtype == at::kBFloat16 && gate_up.scalar_type() == at::kBFloat16),
              "silu_mul computes in float32, or bfloat16 from bfloat16");
  const at::ScalarType result = out_dtype.value_or(dtype);
  TORCH_CHECK(result == dtype || result == at::kBFloat16, "silu_mul returns its dtype or bfloat16");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options().dtype(result));
  silu_mul_into(gate_up.scalar_type(), gate_up.data_ptr(), dtype, result, out.data_ptr(), rows, inter);
  return out;
}

// ---- This step's K and V into the pool (attention/sdpa.py), one call a layer where torch's were two scatters (an
// int8 pool: a dozen calls and four scatters). A pool of the model's dtype takes them as they are. An int8 pool (for a
// step where nothing reads them but the pool: no prefill attended by SDPA over its rows in flight) takes each
// (token, KV head) row quantized as engine/quant.py's quantize_int8 does it, scale = max(max|x| / 127, 1e-12) and
// q = clamp(round(x / scale), -127, 127), rounding half to even: the same integers and scales bit for bit (tested).
namespace {
// K or V of a step as pointers: [rows, kv, dim] of its dtype, with its row and head strides (dim contiguous)
struct Rows3 {
  const void* p;
  int64_t row_stride, head_stride;
};

template <typename T>
void quantize_into(Rows3 x, int64_t rows, int64_t kv, int64_t dim, const int64_t* slots, int8_t* pool, float* scales) {
  const int64_t row_stride = x.row_stride, head_stride = x.head_stride;
  const T* xp = static_cast<const T*>(x.p);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t h = 0; h < kv; ++h) {
      const T* src = xp + t * row_stride + h * head_stride;
      float top = 0.f;
      for (int64_t d = 0; d < dim; ++d) top = std::max(top, std::fabs(static_cast<float>(src[d])));
      const float s = std::max(top / 127.f, kTiny);
      const int64_t at = slots[t] * kv + h;
      int8_t* dst = pool + at * dim;
      for (int64_t d = 0; d < dim; ++d) {
        dst[d] = static_cast<int8_t>(std::min(std::max(std::nearbyint(static_cast<float>(src[d]) / s), -127.f), 127.f));
      }
      scales[at] = s;
    }
  }
}

template <typename T>
void copy_into(Rows3 x, int64_t rows, int64_t kv, int64_t dim, const int64_t* slots, T* pool) {
  const T* xp = static_cast<const T*>(x.p);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t h = 0; h < kv; ++h) {
      std::memcpy(pool + (slots[t] * kv + h) * dim, xp + t * x.row_stride + h * x.head_stride, dim * sizeof(T));
    }
  }
}

// write_kv below over pointers: k and v of type (float32 or bf16) into pools of that type, or int8 ones with scales
// (k_scale non-null)
void write_kv_into(at::ScalarType type, Rows3 k, Rows3 v, int64_t rows, int64_t kv, int64_t dim, const int64_t* slots,
                   void* k_pool, void* v_pool, float* k_scale, float* v_scale) {
  using B = c10::BFloat16;
  const bool bf16 = type == at::kBFloat16;
  for (int kind = 0; kind < 2; ++kind) {
    const Rows3 x = kind == 0 ? k : v;
    void* pool = kind == 0 ? k_pool : v_pool;
    if (k_scale != nullptr) {
      float* scales = kind == 0 ? k_scale : v_scale;
      bf16 ? quantize_into<B>(x, rows, kv, dim, slots, static_cast<int8_t*>(pool), scales)
           : quantize_into<float>(x, rows, kv, dim, slots, static_cast<int8_t*>(pool), scales);
    } else {
      bf16 ? copy_into<B>(x, rows, kv, dim, slots, static_cast<B*>(pool))
           : copy_into<float>(x, rows, kv, dim, slots, static_cast<float*>(pool));
    }
  }
}
}  // namespace

// k and v [T, KV, D] (float32 or bfloat16, any row and head strides, D contiguous), slots [T] -> written into the
// pools k_pool and v_pool [slots, KV, D]: of k's dtype as they are, or int8 with float32 scales k_scale and v_scale
// [slots, KV] (given for an int8 pool, and only then)
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, at::Tensor& k_pool,
              at::Tensor& v_pool, const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  for (const auto& x : {k, v}) {
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && float_or_bf16(x) && x.sizes() == k.sizes(),
                "k and v must be float32 or bfloat16 CPU tensors [T, KV, D] of one shape, D contiguous");
  }
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "k and v must be of one dtype");
  const bool int8_pool = k_pool.scalar_type() == at::kChar;
  check_pools(k_pool, v_pool, k.size(1), k.size(2), k.scalar_type(), "k's dtype", k_scale, v_scale);
  const int64_t* sp = check_indices(slots, k.size(0), k_pool.size(0), "slots", "a slot is past the pool");
  write_kv_into(k.scalar_type(), {k.data_ptr(), k.stride(0), k.stride(1)}, {v.data_ptr(), v.stride(0), v.stride(1)},
                k.size(0), k.size(1), k.size(2), sp, k_pool.data_ptr(), v_pool.data_ptr(),
                int8_pool ? k_scale->data_ptr<float>() : nullptr, int8_pool ? v_scale->data_ptr<float>() : nullptr);
}

// ---- Weight-only matmuls (models/linear.py's Int8Linear and Int4Linear): y [M, N] float32 = x [M, K] @ W.T, the
// weights stored quantized and widened to floats in registers as they are read, multiplied by the activations as
// they come (float32, or bf16 widened exactly), with float32 sums. torch's kernels for both take bf16 activations
// only, and at one row on the Intel machine moved ~10 GB/s of weights where fp32 oneDNN moves ~19.
// Each (row, output) sum runs over k in the same order whatever else is in the call: 16 lanes, lane l adding the
// products of k = l, l + 16, ..., one fused multiply-add each, then the lanes added in a fixed tree (then int8's
// scale): so a row's result does not depend on how many rows share the call (tested). Blocks of up to 4 rows by 4
// outputs share each load: a weight vector, once widened, serves 4 rows, an activation vector 4 outputs. The next
// block's weights (int4: the one after) are prefetched as this one is read (a hint only: past the last row it
// touches nothing), which doubled int8's speed at one row (SmolLM2's projections: 13.1 -> 7.0 ms a step, ~19 GB/s
// of weights).
namespace {
#if defined(__AVX512F__)
inline void prefetch_rows(const uint8_t* first, int64_t rows, int64_t row_bytes, int64_t at) {
  for (int64_t j = 0; j < rows; ++j) _mm_prefetch(reinterpret_cast<const char*>(first + j * row_bytes + at), _MM_HINT_T0);
}

// int8: q [N, K], symmetric, a float32 scale per output channel: w = q * scale (the scale applied to the sum)
struct Int8Weights {
  const int8_t* q;
  const float* scale;
  int64_t k_len;

  template <int MB, int NB, typename X>
  void block(const X* x, int64_t ldx, int64_t o, float* y, int64_t ldy) const {
    const int8_t* rows = q + o * k_len;
    __m512 acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_len; k += 16) {
      if ((k & 63) == 0) prefetch_rows(reinterpret_cast<const uint8_t*>(rows + NB * k_len), NB, k_len, k);
      __m512 w[NB];
      for (int j = 0; j < NB; ++j) w[j] = load16(rows + j * k_len + k);
      for (int i = 0; i < MB; ++i) {
        const __m512 xv = load16(x + i * ldx + k);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]) * scale[o + j];
  }
};

// int4: two per byte, [N, K / 2]: in each run of 32 features, byte c holds feature c in its low nibble and feature
// c + 16 in its high one; asymmetric per group of `group` features (a multiple of 32) with bf16 (scale, mid) pairs
// [N, K / group, 2]: w = (q - 8) * scale + mid. Each group's 16 possible weights are computed first, one fused
// multiply-add (the same floats as engine/quant.py's dequantize_int4), and a vector of 16 nibbles is turned into
// its 16 weights by one permute that looks them up (vpermps reads the low 4 bits of each index). Measured on the
// Intel machine, SmolLM2's projections of a step at one row: unpacking and converting each nibble instead 11.3 ms
// (torch's kernel 8.6); the lookup with fp32 pairs 9.4 (9.5), with bf16 pairs 6.8 (7.5), prefetching two blocks
// ahead rather than one 6.4 (7.8).
struct Int4Weights {
  const uint8_t* packed;
  const c10::BFloat16* params;
  int64_t k_len, group;

  template <int MB, int NB, typename X>
  void block(const X* x, int64_t ldx, int64_t o, float* y, int64_t ldy) const {
    const int64_t row_bytes = k_len / 2, groups = k_len / group;
    const uint8_t* rows = packed + o * row_bytes;
    const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);  // q - 8
    __m512 acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    __m512 table[NB];
    for (int64_t k = 0; k < k_len; k += 32) {
      if ((k & 127) == 0) prefetch_rows(rows + 2 * NB * row_bytes, NB, row_bytes, k / 2);
      if (k % group == 0) {
        for (int j = 0; j < NB; ++j) {
          int32_t pair;  // (scale, mid) as two bf16: the top halves of their floats
          std::memcpy(&pair, params + ((o + j) * groups + k / group) * 2, 4);
          const __m512i both = _mm512_set1_epi32(pair);
          const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
          const __m512 mid = _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32(0xFFFF0000)));
          table[j] = _mm512_fmadd_ps(levels, scale, mid);
        }
      }
      __m512 w[NB][2];
      for (int j = 0; j < NB; ++j) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + j * row_bytes + k / 2)));
        w[j][0] = _mm512_permutexvar_ps(v, table[j]);
        w[j][1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table[j]);
      }
      for (int i = 0; i < MB; ++i) {
        const __m512 x0 = load16(x + i * ldx + k), x1 = load16(x + i * ldx + k + 16);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(x1, w[j][1], _mm512_fmadd_ps(x0, w[j][0], acc[i][j]));
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
  }
};

template <int NB, typename W, typename X>
void block_rows(const W& w, int64_t rows, const X* x, int64_t ldx, int64_t o, float* y, int64_t ldy) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) w.template block<4, NB>(x + i * ldx, ldx, o, y + i * ldy, ldy);
  switch (rows - i) {
    case 3: w.template block<3, NB>(x + i * ldx, ldx, o, y + i * ldy, ldy); break;
    case 2: w.template block<2, NB>(x + i * ldx, ldx, o, y + i * ldy, ldy); break;
    case 1: w.template block<1, NB>(x + i * ldx, ldx, o, y + i * ldy, ldy); break;
    default: break;
  }
}

// the outputs split between the threads in blocks of 4; each thread takes its blocks against 64 rows at a time
template <typename W, typename X>
void weight_only_matmul(const W& w, const X* xp, int64_t m, int64_t k_len, int64_t n, float* yp) {
  constexpr int64_t kOutputs = 4, kRowChunk = 64;
  const int64_t blocks = (n + kOutputs - 1) / kOutputs;
  pool::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < m; r += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, m - r);
      const X* xr = xp + r * k_len;
      for (int64_t b = begin; b < end; ++b) {
        const int64_t o = b * kOutputs;
        float* yr = yp + r * n + o;
        if (o + kOutputs <= n) {
          block_rows<kOutputs>(w, rows, xr, k_len, o, yr, n);
        } else {
          for (int64_t j = o; j < n; ++j) block_rows<1>(w, rows, xr, k_len, j, yr + j - o, n);
        }
      }
    }
  });
}
#endif

void check_activations(const at::Tensor& x, int64_t k_len, int64_t step) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && float_or_bf16(x),
              "x must be a contiguous float32 or bf16 CPU tensor [M, K]");
  TORCH_CHECK(x.size(1) == k_len, "x has ", x.size(1), " features, the weights ", k_len);
  TORCH_CHECK(k_len % step == 0, "the weight-only kernels need K in multiples of ", step, ", got ", k_len);
}

template <typename W>
at::Tensor run_weight_only(const W& w, const at::Tensor& x, int64_t n) {
  at::Tensor y = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kBFloat16) {
    weight_only_matmul(w, x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), n, y.data_ptr<float>());
  } else {
    weight_only_matmul(w, x.data_ptr<float>(), x.size(0), x.size(1), n, y.data_ptr<float>());
  }
#endif
  return y;
}
}  // namespace

// Whether this build has the weight-only matmuls (AVX-512); without them models/linear.py keeps to torch's kernels
bool weight_only_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// x [M, K] (float32 or bf16, contiguous), q [N, K] int8 (contiguous), scale [N] float32, K a multiple of 16 ->
// y [M, N] float32
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(weight_only_available(), "int8_matmul needs AVX-512");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "q must be a contiguous int8 tensor [N, K]");
  check_activations(x, q.size(1), 16);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous() &&
                  scale.size(0) == q.size(0),
              "scale must be a contiguous float32 tensor [N]");
#if defined(__AVX512F__)
  return run_weight_only(Int8Weights{q.data_ptr<int8_t>(), scale.data_ptr<float>(), q.size(1)}, x, q.size(0));
#else
  return at::Tensor();
#endif
}

// x [M, K] (float32 or bf16, contiguous), packed [N, K / 2] uint8 (two features a byte: in each run of 32, feature
// c in byte c's low nibble, c + 16 in its high one), params [N, K / group, 2] bf16 (scale, mid), group a multiple
// of 32 dividing K -> y [M, N] float32
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params, int64_t group) {
  TORCH_CHECK(weight_only_available(), "int4_matmul needs AVX-512");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be a contiguous uint8 tensor [N, K / 2]");
  const int64_t k_len = packed.size(1) * 2;
  TORCH_CHECK(group > 0 && group % 32 == 0 && k_len % group == 0, "the group size must be a multiple of 32 dividing K (",
              k_len, "), got ", group);
  check_activations(x, k_len, 32);
  TORCH_CHECK(params.scalar_type() == at::kBFloat16 && params.is_contiguous() && params.dim() == 3 &&
                  params.size(0) == packed.size(0) && params.size(1) == k_len / group && params.size(2) == 2,
              "params must be a contiguous bf16 tensor [N, K / group, 2]");
#if defined(__AVX512F__)
  return run_weight_only(Int4Weights{packed.data_ptr<uint8_t>(), params.data_ptr<c10::BFloat16>(), k_len, group}, x,
                         packed.size(0));
#else
  return at::Tensor();
#endif
}

// ---- Dense matmuls (quant/linear.py's Linear on CPU): y [M, N] = x [M, K] @ W.T in the model's dtype, float32 or
// bf16, over a weight packed once at load for the vector registers: 16 outputs a block, the block's weights for each
// k (bf16: each pair of k) one 64-byte vector, [ceil(N / 16), K, 16] float32 or [ceil(N / 16), ceil(K / 2), 16, 2]
// bf16 (zero-padded). Each k broadcasts one activation (bf16: a pair) into one fused multiply-add (bf16: one
// _mm512_dpbf16_ps) per block, 16 sums a vector: no reduction across lanes at the end. A tile of up to 8 rows by
// up to 4 blocks shares each load; a thread takes a group of blocks and runs every 8 rows of x over it while its
// weights sit in its cache. A decode step's projections and LM head of SmolLM2 on the AMD EPYC (`bench kernels`,
// docs/measurements.md): bf16 8.2-8.8 ms on oneDNN's linear (what ran before) at one row, 6.2 on these; 1.2-1.4x
// oneDNN's speed at 1-32 rows in bf16 and float32, 1.02-1.1x at 256.
// Each output's sum runs over k in order, whatever else shares the call: a row's result does not depend on its
// batch (tested). Threads take groups of blocks from a shared counter, not a fixed share each: a thread that the
// OS preempts for a neighbour (a client, the HTTP loop on the same two cores) leaves its groups to the other one.
namespace {
constexpr int64_t kDenseBlock = 16;
constexpr int kDenseRows = 8;
#if defined(__AVX512F__)
constexpr bool kDenseF32 = true;  // what this build multiplies: float32 with AVX-512, bf16 with AVX-512 BF16
#else
constexpr bool kDenseF32 = false;
#endif
#if defined(__AVX512BF16__)
constexpr bool kDenseBf16 = true;
#else
constexpr bool kDenseBf16 = false;
#endif

inline int32_t bf16_pair(const c10::BFloat16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A row tile after a group's first computes from weights the first left in the cache, while the memory idles: it
// fetches a slice of the group that comes next (Ahead) into the cache meanwhile, spread over its steps, so that
// group's first tile does not wait on memory either. Measured with 32 rows (a batch-32 decode step's projections,
// docs/measurements.md, "The next weights fetched ahead, and this CPU's ceilings").
constexpr int64_t kAheadTiles = 8;  // the most row tiles a call fetches ahead in (64 rows)

struct Ahead {
  const char* lines = nullptr;  // the slice's first cache line; nullptr: none
  int64_t count = 0;            // its lines
};

#if defined(__AVX512F__)
// Each block's weights are one stream through memory; with more than one row the kernel computes long enough per
// line that the hardware's prefetcher falls behind, so each stream is prefetched 32 lines (2 KB) ahead (measured
// on the AMD EPYC, SmolLM2's projections: 8 rows bf16 6.3 -> 4.8 ms, float32 9.3 -> 7.7; none helped one row, and 8
// or 16 lines ahead did less). Past a block's end it reaches into the next group's, or nowhere: a hint never faults.
constexpr int64_t kDensePrefetch = 32;

template <int NB, typename T>
inline void dense_prefetch(const T* w, int64_t steps, int64_t step) {
  constexpr int64_t kVector = 64 / sizeof(T);  // elements a step reads of a block: one cache line
  for (int j = 0; j < NB; ++j)
    _mm_prefetch(reinterpret_cast<const char*>(w + (j * steps + step + kDensePrefetch) * kVector), _MM_HINT_T0);
}

// `ahead`'s lines spread evenly over a tile's `steps` steps: each step asks for the ones due by its end, a prefetch
// a line
struct AheadCursor {
  Ahead ahead;
  int64_t steps, owed = 0, next = 0;
  inline void at_step() {
    for (owed += ahead.count; owed >= steps && next < ahead.count; owed -= steps, ++next)
      _mm_prefetch(ahead.lines + next * 64, _MM_HINT_T1);
  }
};

template <int MB, int NB, bool AHEAD = false>
void dense_tile_f32(const float* x, int64_t ldx, const float* w, int64_t k_len, float* y, int64_t ldy,
                    __mmask16 last, Ahead ahead) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  AheadCursor next{ahead, k_len};
  for (int64_t k = 0; k < k_len; ++k) {
    __m512 wv[NB];
    if constexpr (AHEAD) {
      next.at_step();
    } else if constexpr (MB > 1) {
      dense_prefetch<NB>(w, k_len, k);
    }
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w + (j * k_len + k) * kDenseBlock);
    for (int i = 0; i < MB; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xb, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      _mm512_mask_storeu_ps(y + i * ldy + j * kDenseBlock, j == NB - 1 ? last : __mmask16(0xFFFF), acc[i][j]);
}
#endif

#if defined(__AVX512BF16__)
template <int MB, int NB, bool AHEAD = false>
void dense_tile_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t k_len, c10::BFloat16* y,
                     int64_t ldy, __mmask16 last, Ahead ahead) {
  const int64_t pairs = (k_len + 1) / 2, whole = k_len / 2;
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  AheadCursor next{ahead, pairs};
  auto step = [&](int64_t p, const int32_t* xs) {
    __m512i wv[NB];
    if constexpr (AHEAD) {
      next.at_step();
    } else if constexpr (MB > 1) {
      dense_prefetch<NB>(w, pairs, p);
    }
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + (j * pairs + p) * 2 * kDenseBlock);
    for (int i = 0; i < MB; ++i) {
      const __m512i xb = _mm512_set1_epi32(xs[i]);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[j], (__m512bh)xb);
    }
  };
  int32_t xs[MB];
  for (int64_t p = 0; p < whole; ++p) {
    for (int i = 0; i < MB; ++i) xs[i] = bf16_pair(x + i * ldx + 2 * p);
    step(p, xs);
  }
  if (pairs > whole) {  // K odd: the last feature paired with a zero (its packed weight is zero too)
    for (int i = 0; i < MB; ++i) xs[i] = static_cast<int32_t>(x[i * ldx + k_len - 1].x);
    step(whole, xs);
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      _mm256_mask_storeu_epi16(y + i * ldy + j * kDenseBlock, j == NB - 1 ? last : __mmask16(0xFFFF),
                               (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
}
#endif

#if WATCHLLM_AMX
// bf16 on AMX's tiles, over the same packed weight: a block's 16 pairs of k for its 16 outputs are 16 lines of 64
// bytes in a row, which is the layout AMX's B tile takes, so one tile load reads them and one _tile_dpbf16ps adds
// up to 16 rows' 32 products each into a 16 x 16 float tile. It replaces dense_tile_bf16 wherever AMX runs (K a
// multiple of 32): a single row costs as little as there (the tile holds only the rows there are) and hundreds
// ran as fast as oneDNN's AMX linear, which then need no copy of the weights of their own (docs/measurements.md,
// "Against the machine's limits"). The tiles sum in their own order, not dense_tile_bf16's, but always the same
// one: each output adds its pairs of k in order whatever rows share the tile, so a row's result does not depend
// on its batch here either (tested).
constexpr int kAmxBlocks = 4;  // blocks a group: tiles 0-3 hold their sums, 4 the rows of x, 5-7 the weights

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux gives a process AMX's tile registers only once it asks for them (ARCH_REQ_XCOMP_PERM, XTILEDATA); asked
// once per process (oneDNN asks on its own)
bool amx_permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// one group's nb blocks (1-4) against `rows` rows of x (1-16, as the tiles are configured): the sums in tiles 0-3,
// stored through scratch into y in bf16 (the tail block's outputs masked by last)
template <int NB>
void amx_tile_bf16(const char* x, int64_t x_stride, const char* w, int64_t pairs, int rows, c10::BFloat16* y,
                   int64_t ldy, __mmask16 last, float (*scratch)[kDenseBlock]) {
  const int64_t block_bytes = pairs * 64;
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  for (int64_t p = 0; p < pairs; p += 16) {
    _tile_loadd(4, x + p * 4, x_stride);
    _tile_loadd(5, w + p * 64, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB > 1) {
      _tile_loadd(6, w + block_bytes + p * 64, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NB > 2) {
      _tile_loadd(7, w + 2 * block_bytes + p * 64, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NB > 3) {
      _tile_loadd(5, w + 3 * block_bytes + p * 64, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  for (int j = 0; j < NB; ++j) {
    switch (j) {  // a tile's number is part of the instruction
      case 0: _tile_stored(0, scratch, 64); break;
      case 1: _tile_stored(1, scratch, 64); break;
      case 2: _tile_stored(2, scratch, 64); break;
      default: _tile_stored(3, scratch, 64); break;
    }
    for (int i = 0; i < rows; ++i)
      _mm256_mask_storeu_epi16(y + i * ldy + j * kDenseBlock, j == NB - 1 ? last : __mmask16(0xFFFF),
                               (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(scratch[i])));
  }
}

// y [m, n] = x @ W.T over pack_dense's bf16 weight, K a multiple of 32. Rows 16 at a time (the last few copied into
// a zeroed tile of 16 when there are more than 16: their sums are the same, the zero rows' thrown away); up to 16
// rows in one tile of as many. Each thread sets its tiles up for the call and, after, puts back whatever
// configuration it found (torch's own AMX kernels keep theirs configured between calls), or lets the tiles go.
void dense_matmul_amx(const c10::BFloat16* xp, int64_t ldx, const c10::BFloat16* wp, int64_t m, int64_t k_len,
                      int64_t n, c10::BFloat16* yp) {
  const int64_t pairs = k_len / 2, blocks = (n + kDenseBlock - 1) / kDenseBlock;
  const int64_t groups = (blocks + kAmxBlocks - 1) / kAmxBlocks;
  const int rows = static_cast<int>(std::min<int64_t>(m, 16));
  const int64_t whole = m > 16 ? m / 16 * 16 : m, chunks = (m + 15) / 16;
  std::vector<c10::BFloat16> tail;  // the rows past the last whole 16, zero-padded to 16
  if (whole < m) {
    tail.assign(16 * k_len, c10::BFloat16(0.f));
    for (int64_t i = whole; i < m; ++i) std::memcpy(&tail[(i - whole) * k_len], xp + i * ldx, k_len * 2);
  }
  const __mmask16 tail_mask = n % kDenseBlock ? __mmask16((1u << (n % kDenseBlock)) - 1) : __mmask16(0xFFFF);
  const int64_t threads = std::min<int64_t>(pool::threads_for_call(), groups);
  const int64_t chunk = std::max<int64_t>(1, groups / (threads * 8));
  TileConfig mine;
  for (int t = 0; t < 5; ++t) mine.rows[t] = rows, mine.colsb[t] = 64;  // sums and x: `rows` rows
  for (int t = 5; t < 8; ++t) mine.rows[t] = 16, mine.colsb[t] = 64;    // weights: 16 pairs of k
  static thread_local TileConfig found;  // what this thread had configured before the call
  pool::parallel_chunks(
      (groups + chunk - 1) / chunk,
      [&] {
        _tile_storeconfig(&found);
        _tile_loadconfig(&mine);
      },
      [&](int64_t part) {
        alignas(64) float scratch[16][kDenseBlock];
        for (int64_t g = part * chunk, e = std::min(groups, g + chunk); g < e; ++g) {
          const int64_t first = g * kAmxBlocks, count = std::min<int64_t>(kAmxBlocks, blocks - first);
          const __mmask16 last = first + count == blocks ? tail_mask : __mmask16(0xFFFF);
          const char* w = reinterpret_cast<const char*>(wp + first * pairs * 2 * kDenseBlock);
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t i = c * 16;
            const bool padded = i >= whole;
            const char* x = reinterpret_cast<const char*>(padded ? tail.data() : xp + i * ldx);
            const int64_t x_stride = (padded ? k_len : ldx) * 2;
            const int valid = static_cast<int>(std::min<int64_t>(rows, m - i));
            c10::BFloat16* y = yp + i * n + first * kDenseBlock;
            switch (count) {
              case 4: amx_tile_bf16<4>(x, x_stride, w, pairs, valid, y, n, last, scratch); break;
              case 3: amx_tile_bf16<3>(x, x_stride, w, pairs, valid, y, n, last, scratch); break;
              case 2: amx_tile_bf16<2>(x, x_stride, w, pairs, valid, y, n, last, scratch); break;
              default: amx_tile_bf16<1>(x, x_stride, w, pairs, valid, y, n, last, scratch); break;
            }
          }
        }
      },
      [&] {
        if (found.palette != 0) {
          _tile_loadconfig(&found);
        } else {
          _tile_release();
        }
      });
}
#endif

// Whether dense_matmul's bf16 runs on AMX here for inner size k_len (built with it, the OS lets this process use
// it, K a multiple of 32)
bool dense_bf16_on_amx(int64_t k_len) {
#if WATCHLLM_AMX
  return k_len % 32 == 0 && amx_permitted();
#else
  (void)k_len;
  return false;
#endif
}

// Every 8 rows of x, then the 1-7 left, through tile(MB, first row): one group's blocks against each
template <int NB, typename F>
void dense_rows(int64_t m, F&& tile) {
  int64_t i = 0;
  for (; i + kDenseRows <= m; i += kDenseRows) tile(std::integral_constant<int, kDenseRows>{}, i);
  switch (m - i) {
    case 7: tile(std::integral_constant<int, 7>{}, i); break;
    case 6: tile(std::integral_constant<int, 6>{}, i); break;
    case 5: tile(std::integral_constant<int, 5>{}, i); break;
    case 4: tile(std::integral_constant<int, 4>{}, i); break;
    case 3: tile(std::integral_constant<int, 3>{}, i); break;
    case 2: tile(std::integral_constant<int, 2>{}, i); break;
    case 1: tile(std::integral_constant<int, 1>{}, i); break;
    default: break;
  }
}

// groups [0, groups) run by the pool's threads, `chunk` groups a claim: about `claims` claims a thread, so a thread
// the OS stops mid-claim leaves the caller little to wait for. run(g, next): `next` the group this thread runs after
// g, what a kernel fetches ahead: the next of its claim, else the first of the claim it will take at its end of the
// range (taken unless the threads met there); -1 past either end
template <typename F>
void dense_claims(int64_t groups, int64_t claims, F&& run) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool::threads_for_call(), groups));
  const int64_t chunk = std::max<int64_t>(1, groups / (threads * claims));
  pool::parallel_for(0, groups, chunk, [&](int64_t begin, int64_t end) {
    const int64_t after = pool::claims_from_back() ? begin - chunk : end;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t next = g + 1 < end ? g + 1 : after;
      run(g, next >= 0 && next < groups ? next : -1);
    }
  });
}

template <typename T, int NB>
void dense_matmul_nb(const T* xp, int64_t ldx, const T* wp, int64_t m, int64_t k_len, int64_t n, T* yp) {
  const int64_t blocks = (n + kDenseBlock - 1) / kDenseBlock, groups = (blocks + NB - 1) / NB;
  const int64_t block_elems = std::is_same<T, float>::value ? k_len * kDenseBlock : (k_len + 1) / 2 * 2 * kDenseBlock;
  const __mmask16 tail = n % kDenseBlock ? __mmask16((1u << (n % kDenseBlock)) - 1) : __mmask16(0xFFFF);
  // with 2-8 row tiles (a decode step's batch), the later tiles fetch the next group ahead (Ahead): fewer, longer
  // claims then, so most groups have their next in the same claim. With more (a prefill's), the first tile's wait
  // is a small part of a group's time, and the engine's prefill steps measured no faster
  const int64_t tiles = (m + kDenseRows - 1) / kDenseRows;
  const bool fetch_ahead = tiles > 1 && tiles <= kAheadTiles;
  dense_claims(groups, fetch_ahead ? 2 : 8, [&](int64_t g, int64_t after) {
    const int64_t first = g * NB, count = std::min<int64_t>(NB, blocks - first);
    const __mmask16 last = first + count == blocks ? tail : __mmask16(0xFFFF);
    const T* w = wp + first * block_elems;
    T* y = yp + first * kDenseBlock;
    const int64_t next_blocks = fetch_ahead && after >= 0 ? std::min<int64_t>(NB, blocks - after * NB) : 0;
    const int64_t next_lines = next_blocks * block_elems * static_cast<int64_t>(sizeof(T)) / 64;  // whole lines
    const char* next = next_blocks > 0 ? reinterpret_cast<const char*>(wp + after * NB * block_elems) : nullptr;
    auto with = [&](auto nb) {
      dense_rows<decltype(nb)::value>(m, [&](auto mb, int64_t i) {
        constexpr int MB = decltype(mb)::value, B = decltype(nb)::value;
        Ahead ahead;  // tile t of the later ones: its share of the next group's lines
        if (i > 0 && next_lines > 0) {
          const int64_t t = i / kDenseRows - 1, later = tiles - 1;
          const int64_t lo = next_lines * t / later, hi = next_lines * (t + 1) / later;
          ahead = Ahead{next + lo * 64, hi - lo};
        }
        auto tile = [&](auto fetch) {  // fetch: std::bool_constant, whether this tile fetches ahead
          constexpr bool F = decltype(fetch)::value;
          if constexpr (std::is_same<T, float>::value) {
#if defined(__AVX512F__)
            dense_tile_f32<MB, B, F>(xp + i * ldx, ldx, w, k_len, y + i * n, n, last, ahead);
#endif
          } else {
#if defined(__AVX512BF16__)
            dense_tile_bf16<MB, B, F>(xp + i * ldx, ldx, w, k_len, y + i * n, n, last, ahead);
#endif
          }
        };
        // a tile of its own for fetching ahead: the plain one's loop stays as it was, its registers all its sums'
        if (ahead.lines != nullptr) {
          tile(std::true_type{});
        } else {
          tile(std::false_type{});
        }
      });
    };
    switch (count) {
      case 4: if constexpr (NB >= 4) with(std::integral_constant<int, 4>{}); break;
      case 3: if constexpr (NB >= 3) with(std::integral_constant<int, 3>{}); break;
      case 2: with(std::integral_constant<int, 2>{}); break;
      default: with(std::integral_constant<int, 1>{}); break;
    }
  });
}

// 4 blocks a tile for up to 4 rows (16 sums), 3 beyond (24 sums of the 32 vector registers): measured best here
template <typename T>
void dense_matmul_any(const T* xp, int64_t ldx, const T* wp, int64_t m, int64_t k_len, int64_t n, T* yp) {
  if (m <= 4) {
    dense_matmul_nb<T, 4>(xp, ldx, wp, m, k_len, n, yp);
  } else {
    dense_matmul_nb<T, 3>(xp, ldx, wp, m, k_len, n, yp);
  }
}
}  // namespace

// Which dtypes this build multiplies with dense_matmul: float32 with AVX-512, bf16 with AVX-512 BF16
std::vector<std::string> dense_dtypes() {
  std::vector<std::string> out;
  if (kDenseF32) out.emplace_back("float32");
  if (kDenseBf16) out.emplace_back("bfloat16");
  return out;
}

// Whether this build's bf16 dense_matmul runs on AMX here (for K a multiple of 32; elsewhere AVX-512 BF16's dot
// products): built with it and the OS lets this process use the tiles
bool dense_amx() { return dense_bf16_on_amx(32); }

// w [N, K] float32 or bf16 -> its packed layout (see above), zero-padded to whole blocks and (bf16) whole pairs
at::Tensor pack_dense(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && float_or_bf16(w), "w must be a float32 or bf16 CPU tensor [N, K]");
  const int64_t n = w.size(0), k_len = w.size(1), blocks = (n + kDenseBlock - 1) / kDenseBlock;
  TORCH_CHECK(n > 0 && k_len > 0, "w must not be empty, got ", n, " x ", k_len);
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  at::Tensor padded = at::zeros({blocks * kDenseBlock, bf16 ? k_len + k_len % 2 : k_len}, w.options());
  padded.narrow(0, 0, n).narrow(1, 0, k_len).copy_(w);
  if (!bf16) {
    return padded.view({blocks, kDenseBlock, k_len}).permute({0, 2, 1}).contiguous();
  }
  const int64_t pairs = padded.size(1) / 2;
  return padded.view({blocks, kDenseBlock, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

namespace {
// packed holds pack_dense's layout of a [n, k_len] weight of that dtype, and this build multiplies it
void check_dense_packed(const at::Tensor& packed, at::ScalarType dtype, int64_t k_len, int64_t n) {
  TORCH_CHECK(packed.scalar_type() == dtype && packed.is_contiguous(), "packed must be pack_dense's tensor in x's dtype");
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t blocks = (n + kDenseBlock - 1) / kDenseBlock;
  TORCH_CHECK(n > 0 && packed.size(0) == blocks &&
                  (bf16 ? packed.dim() == 4 && packed.size(1) == (k_len + 1) / 2 && packed.size(2) == kDenseBlock &&
                              packed.size(3) == 2
                        : packed.dim() == 3 && packed.size(1) == k_len && packed.size(2) == kDenseBlock),
              "packed does not hold a [", n, ", ", k_len, "] weight (pack_dense's layout), got ", packed.sizes());
  TORCH_CHECK(bf16 ? kDenseBf16 : kDenseF32, "dense_matmul in ",
              bf16 ? "bf16 needs AVX-512 BF16" : "float32 needs AVX-512", " in this build");
}

// dense_matmul below over pointers: x [m, k_len] (row stride ldx) and y [m, n] of dtype
void dense_into(at::ScalarType dtype, const void* x, int64_t ldx, const void* packed, int64_t m, int64_t k_len,
                int64_t n, void* y) {
  using B = c10::BFloat16;
  if (dtype == at::kBFloat16 && dense_bf16_on_amx(k_len)) {
#if WATCHLLM_AMX
    dense_matmul_amx(static_cast<const B*>(x), ldx, static_cast<const B*>(packed), m, k_len, n, static_cast<B*>(y));
#endif
  } else if (dtype == at::kBFloat16) {
    dense_matmul_any(static_cast<const B*>(x), ldx, static_cast<const B*>(packed), m, k_len, n, static_cast<B*>(y));
  } else {
    dense_matmul_any(static_cast<const float*>(x), ldx, static_cast<const float*>(packed), m, k_len, n,
                     static_cast<float*>(y));
  }
}
}  // namespace

// x [M, K] (rows contiguous, any row stride), packed from pack_dense of a [N, K] weight in x's dtype -> y [M, N]
at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && float_or_bf16(x) && x.stride(1) == 1,
              "x must be a float32 or bf16 CPU tensor [M, K] with contiguous rows");
  const int64_t k_len = x.size(1);
  check_dense_packed(packed, x.scalar_type(), k_len, n);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  dense_into(x.scalar_type(), x.data_ptr(), x.size(0) > 1 ? x.stride(0) : k_len, packed.data_ptr(), x.size(0), k_len,
             n, y.data_ptr());
  return y;
}

// ---- int4 on AVX-512 VNNI's integer dot products (quant/linear.py's Int4Linear where the CPU has them). int4_matmul
// above widens every weight to a float and multiplies it in floats: per 32 weights of an output a widening, a shift,
// two lookups and two multiply-adds, and for groups of 32 a group's 16 levels besides, so at one row it ran out of
// instructions before the memory ran out of bytes (docs/measurements.md, "Against the machine's limits"). Here the
// activations are made integers once per call instead, and the weights stay integers: one _mm512_dpbusd_epi32 multiplies
// 64 unsigned 4-bit weights (16 outputs x 4 features) by 4 signed 8-bit activations and adds them in int32, exactly.
// The activations: each row's runs of 32 features over their largest magnitude m, in two 8-bit parts, h = round(x *
// 127 / m) and l = round((x * 127 / m - h) * 128), so x = m / (127 * 128) * (128 h + l) to within m / 32,512 (the
// second part's half step), about 15 bits: a precision change from the float path's exact products, measured in
// docs/measurements.md's quality table, far below int4's own rounding of the weights and bf16's of activations.
// Each run of 32 then adds, per output, sum(q * (128 h + l)) = 128 * dot(q, h) + dot(q, l) (two dot products, int32)
// and, in floats, w = (q - 8) * scale + mid = q * scale + w0 (w0 = mid - 8 * scale) gives
//   y += unit * (scale * sum(q * (128 h + l)) + w0 * sum(128 h + l)),  unit = m / (127 * 128).
// Layout: 16 outputs a block; per block and group, the 16 outputs' (scale, mid) bf16 pairs in one 64-byte line, then
// for each run of 32 features 4 vectors of 64 bytes, vector z holding for output j features 4z..4z+3 in the low
// nibbles of bytes 4j..4j+3 and 16+4z..16+4z+3 in their high nibbles (the dot products' order). A thread takes 4
// blocks at a time and reads them as 4 streams side by side, each block's pairs in its own stream: at one row both
// the pairs in a tensor of their own and the 4 blocks interleaved into one stream read measurably slower
// (docs/measurements.md, "Against the machine's limits"). A row's result does not depend on the rows beside it (each
// row is made integers on its own; tested).
namespace {
constexpr int64_t kQ4Block = 16;       // outputs a block
constexpr int64_t kQ4Run = 32;         // features a run: one activation scale, 256 bytes of a block's weights
constexpr int kQ4Blocks = 4;           // blocks a thread's group
constexpr float kQ4Residual = 128.f;   // the second part's steps per step of the first

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define WATCHLLM_INT4_VNNI 1
// a row's runs of 32 features -> [runs][2][32] int8 (h then l), the scale m / (127 * 128) of each run, sum(128 h + l)
// and that sum times the scale
template <typename X>
void q4_quantize_row(const X* x, int64_t k_len, int8_t* q, float* unit, float* unit_sum, int32_t* sums) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t r = 0; r < k_len / kQ4Run; ++r) {
    const __m512 a = load16(x + r * kQ4Run), b = load16(x + r * kQ4Run + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
    const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    __m512i sum = _mm512_setzero_si512();
    int8_t* out = q + r * 2 * kQ4Run;
    for (int half = 0; half < 2; ++half) {
      const __m512 scaled = _mm512_mul_ps(half ? b : a, inv);
      const __m512 h = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i hi = _mm512_cvtps_epi32(h);
      const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(scaled, h), _mm512_set1_ps(kQ4Residual)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + half * 16), _mm512_cvtepi32_epi8(hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + kQ4Run + half * 16), _mm512_cvtepi32_epi8(lo));
      sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_slli_epi32(hi, 7), lo));
    }
    unit[r] = top / (127.f * kQ4Residual);
    sums[r] = _mm512_reduce_add_epi32(sum);
    unit_sum[r] = unit[r] * static_cast<float>(sums[r]);
  }
}

// A call's rows made integers (q4_quantize_row's), rows split between the threads where there are many
// (the calling thread's scratch: valid until its next call)
struct IntegerRows {
  int64_t runs;
  int8_t* q;
  float *unit, *unit_sum;
  int32_t* sums;

  template <typename X>
  IntegerRows(const X* xp, int64_t m, int64_t k_len)
      : runs(k_len / kQ4Run), q(scratch<int8_t, Use::kRowsQ>(m * 2 * k_len)),
        unit(scratch<float, Use::kRowsUnit>(m * runs)), unit_sum(scratch<float, Use::kRowsUnitSum>(m * runs)),
        sums(scratch<int32_t, Use::kRowsSums>(m * runs)) {
    pool::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        q4_quantize_row(xp + i * k_len, k_len, q + i * 2 * k_len, unit + i * runs, unit_sum + i * runs,
                        sums + i * runs);
    });
  }
};

// runs ahead each run asks for (a hint: the hardware's prefetcher mostly keeps up with the one stream on its own)
constexpr int64_t kQ4Ahead = 4;

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// MB rows against NB blocks (y: MB rows of NB * 16 floats, the last block's outputs masked by last)
template <int MB, int NB>
void q4_tile(const int8_t* q, int64_t q_stride, const float* unit, const float* unit_sum, int64_t s_stride,
             const uint8_t* w, int64_t block_bytes, int64_t runs, int64_t runs_per_group, float* y, int64_t ldy,
             __mmask16 last, const uint8_t* next) {
  const int64_t group_bytes = 64 + runs_per_group * 256;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i top_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t g = r / runs_per_group;
    const uint8_t* run = w + g * group_bytes + 64 + (r - g * runs_per_group) * 256;  // block 0's run r
    if (next == nullptr || r + kQ4Ahead < runs) {
      for (int j = 0; j < NB; ++j)  // past a block's end: the next block's start (a hint never faults)
        for (int z = 0; z < 5; ++z)
          _mm_prefetch(reinterpret_cast<const char*>(run + j * block_bytes + kQ4Ahead * 320 + z * 64), _MM_HINT_T0);
    } else {  // the last runs: the start of the group this thread runs next (at one row; else null)
      const uint8_t* ahead = next + (r + kQ4Ahead - runs) * 320;
      for (int j = 0; j < NB; ++j)
        for (int z = 0; z < 5; ++z)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + j * block_bytes + z * 64), _MM_HINT_T0);
    }
    __m512i hi_dot[MB][NB], lo_dot[MB][NB];  // dot(q, h) and dot(q, l) of this run
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) hi_dot[i][j] = lo_dot[i][j] = _mm512_setzero_si512();
    for (int z = 0; z < 4; ++z) {
      __m512i low[NB], high[NB];
      for (int j = 0; j < NB; ++j) {
        const __m512i v = _mm512_loadu_si512(run + j * block_bytes + z * 64);
        low[j] = _mm512_and_si512(v, nibble);
        high[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
      for (int i = 0; i < MB; ++i) {
        const int8_t* qr = q + i * q_stride + r * 2 * kQ4Run;
        const __m512i h0 = broadcast4(qr + 4 * z), h1 = broadcast4(qr + 16 + 4 * z);
        const __m512i l0 = broadcast4(qr + kQ4Run + 4 * z), l1 = broadcast4(qr + kQ4Run + 16 + 4 * z);
        for (int j = 0; j < NB; ++j) {
          hi_dot[i][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(hi_dot[i][j], low[j], h0), high[j], h1);
          lo_dot[i][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lo_dot[i][j], low[j], l0), high[j], l1);
        }
      }
    }
    __m512 scale[NB], w0[NB];
    for (int j = 0; j < NB; ++j) {  // (scale, mid) as bf16 pairs: the top halves of their floats
      const __m512i pair = _mm512_loadu_si512(w + j * block_bytes + g * group_bytes);
      scale[j] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      w0[j] = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale[j], _mm512_castsi512_ps(_mm512_and_si512(pair, top_half)));
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 u = _mm512_set1_ps(unit[i * s_stride + r]), us = _mm512_set1_ps(unit_sum[i * s_stride + r]);
      for (int j = 0; j < NB; ++j) {
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(hi_dot[i][j], 7), lo_dot[i][j]);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(u, scale[j]), acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(us, w0[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      _mm512_mask_storeu_ps(y + i * ldy + j * kQ4Block, j == NB - 1 ? last : __mmask16(0xFFFF), acc[i][j]);
}

// The loop int4's and int8's VNNI kernels share: the output blocks in groups of kQ4Blocks, a group to a thread; in
// each, two rows share each weight vector two blocks at a time (more would spill), then an odd last row takes the
// group's blocks at once. tile(mb, nb, i, block, mask, next) multiplies rows i.. (mb of them, a
// std::integral_constant) by the blocks from `block` on (nb of them), the last block's outputs masked by `mask`;
// `next`: at one row, the first block of the group this thread runs next (dense_claims'), to fetch ahead; else -1.
template <typename Tile>
void vnni_tiles(int64_t m, int64_t n, Tile&& tile) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  const int64_t blocks = (n + kQ4Block - 1) / kQ4Block;
  const __mmask16 tail = n % kQ4Block ? __mmask16((1u << (n % kQ4Block)) - 1) : __mmask16(0xFFFF);
  dense_claims((blocks + kQ4Blocks - 1) / kQ4Blocks, 8, [&](int64_t g, int64_t next) {
    const int64_t first = g * kQ4Blocks, count = std::min<int64_t>(kQ4Blocks, blocks - first);
    const __mmask16 last = first + count == blocks ? tail : __mmask16(0xFFFF);
    auto rows = [&](auto nb) {
      constexpr int NB = decltype(nb)::value;
      int64_t i = 0;
      for (; i + 2 <= m; i += 2)
        for (int j = 0; j < NB; j += 2) {
          if (j + 2 <= NB)
            tile(Two{}, Two{}, i, first + j, j + 2 == NB ? last : __mmask16(0xFFFF), -1);
          else
            tile(Two{}, One{}, i, first + j, last, -1);
        }
      if (i < m) tile(One{}, nb, i, first, last, m == 1 && next >= 0 ? next * kQ4Blocks : -1);
    };
    switch (count) {
      case 4: rows(std::integral_constant<int, 4>{}); break;
      case 3: rows(std::integral_constant<int, 3>{}); break;
      case 2: rows(Two{}); break;
      default: rows(One{}); break;
    }
  });
}

template <typename X>
void int4_vnni_run(const X* xp, int64_t m, int64_t k_len, const uint8_t* wp, int64_t group, int64_t n, float* yp) {
  const int64_t runs = k_len / kQ4Run, groups = k_len / group, block_bytes = groups * 64 + runs * 256;
  IntegerRows rows_as_integers(xp, m, k_len);
  const int8_t* q = rows_as_integers.q;
  const float *unit = rows_as_integers.unit, *unit_sum = rows_as_integers.unit_sum;
  vnni_tiles(m, n, [&](auto mb, auto nb, int64_t i, int64_t block, __mmask16 last, int64_t next) {
    q4_tile<decltype(mb)::value, decltype(nb)::value>(
        q + i * 2 * k_len, 2 * k_len, unit + i * runs, unit_sum + i * runs, runs, wp + block * block_bytes,
        block_bytes, runs, group / kQ4Run, yp + i * n + block * kQ4Block, n, last,
        next >= 0 ? wp + next * block_bytes : nullptr);
  });
}

// int8 weights [N, K] (symmetric per output, a float32 scale each) on the same dot products: the weights stored as
// q + 128 (unsigned, what _mm512_dpbusd_epi32 takes first), 16 outputs a block, per run of 32 features 8 vectors of 64
// bytes (vector z: features 4z..4z+3 of output j in bytes 4j..4j+3), [N / 16, K / 32, 8, 16, 4], read as int4's. Each
// run adds, per output, sum((q + 128) * (128 h + l)) - 128 * sum(128 h + l) = sum(q * (128 h + l)), exactly in int32,
// times the run's scale; the output's scale at the end.
template <int MB, int NB>
void q8_tile(const int8_t* q, int64_t q_stride, const float* unit, const int32_t* sums, int64_t s_stride,
             const uint8_t* w, int64_t block_bytes, const float* scale, int64_t runs, float* y, int64_t ldy,
             __mmask16 last, const uint8_t* next) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t r = 0; r < runs; ++r) {
    const uint8_t* ahead =  // the last runs: the start of the group this thread runs next, as int4's
        next == nullptr || r + kQ4Ahead < runs ? w + (r + kQ4Ahead) * 512 : next + (r + kQ4Ahead - runs) * 512;
    for (int j = 0; j < NB; ++j)
      for (int z = 0; z < 8; ++z)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * block_bytes + z * 64), _MM_HINT_T0);
    __m512i hi_dot[MB][NB], lo_dot[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) hi_dot[i][j] = lo_dot[i][j] = _mm512_setzero_si512();
    for (int z = 0; z < 8; ++z) {
      __m512i v[NB];
      for (int j = 0; j < NB; ++j) v[j] = _mm512_loadu_si512(w + j * block_bytes + r * 512 + z * 64);
      for (int i = 0; i < MB; ++i) {
        const int8_t* qr = q + i * q_stride + r * 2 * kQ4Run;
        const __m512i h = broadcast4(qr + 4 * z), l = broadcast4(qr + kQ4Run + 4 * z);
        for (int j = 0; j < NB; ++j) {
          hi_dot[i][j] = _mm512_dpbusd_epi32(hi_dot[i][j], v[j], h);
          lo_dot[i][j] = _mm512_dpbusd_epi32(lo_dot[i][j], v[j], l);
        }
      }
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 u = _mm512_set1_ps(unit[i * s_stride + r]);
      const __m512i bias = _mm512_set1_epi32(sums[i * s_stride + r] * 128);  // the +128 of every weight
      for (int j = 0; j < NB; ++j) {
        const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi_dot[i][j], 7), lo_dot[i][j]), bias);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), u, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      _mm512_mask_storeu_ps(y + i * ldy + j * kQ4Block, j == NB - 1 ? last : __mmask16(0xFFFF),
                            _mm512_mul_ps(acc[i][j], _mm512_loadu_ps(scale + j * kQ4Block)));
}

template <typename X>
void int8_vnni_run(const X* xp, int64_t m, int64_t k_len, const uint8_t* wp, const float* scale, int64_t n,
                   float* yp) {
  const int64_t runs = k_len / kQ4Run, block_bytes = runs * 512;
  IntegerRows rows_as_integers(xp, m, k_len);
  const int8_t* q = rows_as_integers.q;
  const float* unit = rows_as_integers.unit;
  const int32_t* sums = rows_as_integers.sums;
  vnni_tiles(m, n, [&](auto mb, auto nb, int64_t i, int64_t block, __mmask16 last, int64_t next) {
    q8_tile<decltype(mb)::value, decltype(nb)::value>(
        q + i * 2 * k_len, 2 * k_len, unit + i * runs, sums + i * runs, runs, wp + block * block_bytes, block_bytes,
        scale + block * kQ4Block, runs, yp + i * n + block * kQ4Block, n, last,
        next >= 0 ? wp + next * block_bytes : nullptr);
  });
}
#else
#define WATCHLLM_INT4_VNNI 0
#endif
}  // namespace

// x [M, K] (float32 or bf16, contiguous; K a multiple of 32), packed: the weights q + 128 in the layout above,
// [ceil(N / 16) * 16, K] uint8, scale [ceil(N / 16) * 16] float32 (zero past N) -> y [M, n] float32
namespace {
void check_int8_vnni_packed(const at::Tensor& packed, const at::Tensor& scale, int64_t k_len, int64_t n) {
  TORCH_CHECK(WATCHLLM_INT4_VNNI, "int8_matmul_vnni needs AVX-512 VNNI");
  TORCH_CHECK(k_len % kQ4Run == 0, "the weight-only kernels need K in multiples of ", kQ4Run, ", got ", k_len);
  const int64_t blocks = (n + kQ4Block - 1) / kQ4Block;
  TORCH_CHECK(n > 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == blocks * kQ4Block && packed.size(1) == k_len,
              "packed must be a contiguous uint8 tensor [", blocks * kQ4Block, ", ", k_len, "], got ", packed.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1 &&
                  scale.size(0) == blocks * kQ4Block,
              "scale must be a contiguous float32 tensor [", blocks * kQ4Block, "], got ", scale.sizes());
}

// int8_matmul_vnni below over pointers: x [m, k_len] of x_type (contiguous), y [m, n] float32
void int8_vnni_into(at::ScalarType x_type, const void* x, int64_t m, int64_t k_len, const void* packed,
                    const float* scale, int64_t n, float* y) {
#if WATCHLLM_INT4_VNNI
  const uint8_t* wp = static_cast<const uint8_t*>(packed);
  x_type == at::kBFloat16 ? int8_vnni_run(static_cast<const c10::BFloat16*>(x), m, k_len, wp, scale, n, y)
                          : int8_vnni_run(static_cast<const float*>(x), m, k_len, wp, scale, n, y);
#endif
}
}  // namespace

at::Tensor int8_matmul_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n) {
  const int64_t k_len = x.dim() == 2 ? x.size(1) : 0;
  check_activations(x, k_len, kQ4Run);
  check_int8_vnni_packed(packed, scale, k_len, n);
  at::Tensor y = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return y;
  int8_vnni_into(x.scalar_type(), x.data_ptr(), x.size(0), k_len, packed.data_ptr(), scale.data_ptr<float>(), n,
                 y.data_ptr<float>());
  return y;
}

// Whether this build has int4_matmul_vnni (AVX-512 VNNI); without it Int4Linear runs int4_matmul
bool vnni_available() { return WATCHLLM_INT4_VNNI; }

// x [M, K] (float32 or bf16, contiguous; K a multiple of 32), packed: the weights' levels and their (scale, mid) pairs
// in the layout above, [ceil(N / 16) * 16, K / 2 + 4 * K / group] uint8, group a multiple of 32 dividing K -> y [M, n]
// float32
namespace {
void check_int4_vnni_packed(const at::Tensor& packed, int64_t group, int64_t k_len, int64_t n) {
  TORCH_CHECK(vnni_available(), "int4_matmul_vnni needs AVX-512 VNNI");
  TORCH_CHECK(k_len % kQ4Run == 0, "the weight-only kernels need K in multiples of ", kQ4Run, ", got ", k_len);
  TORCH_CHECK(group > 0 && group % kQ4Run == 0 && k_len % group == 0,
              "the group size must be a multiple of 32 dividing K (", k_len, "), got ", group);
  const int64_t blocks = (n + kQ4Block - 1) / kQ4Block;
  TORCH_CHECK(n > 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == blocks * kQ4Block && packed.size(1) == k_len / 2 + 4 * (k_len / group),
              "packed must be a contiguous uint8 tensor [", blocks * kQ4Block, ", ", k_len / 2 + 4 * (k_len / group),
              "], got ", packed.sizes());
}

// int4_matmul_vnni below over pointers: x [m, k_len] of x_type (contiguous), y [m, n] float32
void int4_vnni_into(at::ScalarType x_type, const void* x, int64_t m, int64_t k_len, const void* packed, int64_t group,
                    int64_t n, float* y) {
#if WATCHLLM_INT4_VNNI
  const uint8_t* wp = static_cast<const uint8_t*>(packed);
  x_type == at::kBFloat16 ? int4_vnni_run(static_cast<const c10::BFloat16*>(x), m, k_len, wp, group, n, y)
                          : int4_vnni_run(static_cast<const float*>(x), m, k_len, wp, group, n, y);
#endif
}
}  // namespace

at::Tensor int4_matmul_vnni(const at::Tensor& x, const at::Tensor& packed, int64_t group, int64_t n) {
  const int64_t k_len = x.dim() == 2 ? x.size(1) : 0;
  check_activations(x, k_len, kQ4Run);
  check_int4_vnni_packed(packed, group, k_len, n);
  at::Tensor y = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return y;
  int4_vnni_into(x.scalar_type(), x.data_ptr(), x.size(0), k_len, packed.data_ptr(), group, n, y.data_ptr<float>());
  return y;
}

// ---- A step's decoder layers in one call (models/llama.py's DecoderStack): where every step of a layer runs on the
// kernels above (the C++ layer steps, a projection kernel of this file, the C++ KV write and attention over the
// pool), the Python loop over the layers called them one by one, about fifteen Python calls and tensor views a layer;
// here the same kernels run in the same order, on the same dtypes, so the floats are the same as the loop's (tested
// bit for bit). The step's inputs are checked once, and the layers' intermediates live in one buffer a step, handed
// to the kernels as pointers: a tensor each (about 16 allocations and views a layer) cost about 0.4 ms of an int4
// step at one row (docs/measurements.md, "A step's layers over one buffer"). Built once per model: the weights, held.
namespace {
enum ProjectionKind : int64_t { kProjectDense = 0, kProjectInt8Vnni = 1, kProjectInt4Vnni = 2 };

at::ScalarType promoted(at::ScalarType a, at::ScalarType b) { return a == b ? a : at::kFloat; }

// out [rows, cols] of out_type (contiguous) = a [rows, cols] of a_type (row stride lda) op b [rows, cols] of b_type
// (row stride ldb: 0 broadcasts one row, a bias); float32 or bf16 each, every element as torch computes it, in float
// and rounded to out_type. b null: a converted
template <typename Op>
void elementwise(at::ScalarType a_type, const void* a, int64_t lda, at::ScalarType b_type, const void* b, int64_t ldb,
                 at::ScalarType out_type, void* out, int64_t rows, int64_t cols, Op op) {
  using B = c10::BFloat16;
  auto run = [&](auto* ap, auto* bp, auto* op_out) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        op_out[r * cols + c] = static_cast<std::remove_pointer_t<decltype(op_out)>>(op(
            static_cast<float>(ap[r * lda + c]), bp == nullptr ? 0.f : static_cast<float>(bp[r * ldb + c])));
  };
  auto with_out = [&](auto* ap, auto* bp) {
    out_type == at::kFloat ? run(ap, bp, static_cast<float*>(out)) : run(ap, bp, static_cast<B*>(out));
  };
  auto with_b = [&](auto* ap) {
    b_type == at::kFloat ? with_out(ap, static_cast<const float*>(b)) : with_out(ap, static_cast<const B*>(b));
  };
  a_type == at::kFloat ? with_b(static_cast<const float*>(a)) : with_b(static_cast<const B*>(a));
}
}  // namespace

class DecoderStack {
 public:
  // per layer, in order: norms [input, post], projections [qkv, o, gate_up, down] each as kind, packed weight, its
  // scale (int8) or an empty tensor, group (int4) or 0, output features, and whether the step before hands it bf16
  // (the norm's or the activation's dtype argument); qkv_bias and o_bias empty where the model has none
  DecoderStack(std::vector<at::Tensor> norms, std::vector<int64_t> kinds, std::vector<at::Tensor> packed,
               std::vector<at::Tensor> scales, std::vector<int64_t> groups, std::vector<int64_t> outs,
               std::vector<bool> bf16_in, std::vector<at::Tensor> qkv_bias, std::vector<at::Tensor> o_bias,
               int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, at::ScalarType dtype)
      : norms_(std::move(norms)), kinds_(std::move(kinds)), packed_(std::move(packed)), scales_(std::move(scales)),
        groups_(std::move(groups)), outs_(std::move(outs)), bf16_in_(std::move(bf16_in)),
        qkv_bias_(std::move(qkv_bias)), o_bias_(std::move(o_bias)), layers_(static_cast<int64_t>(qkv_bias_.size())),
        heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), dtype_(dtype) {
    const size_t n = static_cast<size_t>(layers_);
    TORCH_CHECK(n > 0 && norms_.size() == 2 * n && kinds_.size() == 4 * n && packed_.size() == 4 * n &&
                    scales_.size() == 4 * n && groups_.size() == 4 * n && outs_.size() == 4 * n &&
                    bf16_in_.size() == 4 * n && o_bias_.size() == n,
                "a DecoderStack takes 2 norms and 4 projections a layer");
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16, "a DecoderStack runs float32 or bfloat16 models");
    TORCH_CHECK(heads_ > 0 && kv_heads_ > 0 && heads_ % kv_heads_ == 0 && head_dim_ > 0 && head_dim_ % 2 == 0,
                "query heads must be a multiple of KV heads, the head size even");
    hidden_ = norms_[0].numel();
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    for (const auto& w : norms_) {
      TORCH_CHECK(w.scalar_type() == dtype_ && w.dim() == 1 && w.numel() == hidden_ && w.is_contiguous(),
                  "each norm's weight must be [hidden] in the model's dtype");
    }
    for (int64_t i = 0; i < layers_; ++i) {
      const int64_t p = 4 * i;
      TORCH_CHECK(outs_[p] == q_size + 2 * kv_size && outs_[p + 1] == hidden_ && outs_[p + 2] % 2 == 0 &&
                      outs_[p + 3] == hidden_,
                  "layer ", i, "'s projections do not fit its heads and hidden size");
      for (const auto& [bias, size] : {std::pair{qkv_bias_[i], outs_[p]}, std::pair{o_bias_[i], hidden_}}) {
        TORCH_CHECK(!has(bias) || (bias.scalar_type() == dtype_ && bias.dim() == 1 && bias.numel() == size &&
                                    bias.is_contiguous()),
                    "a bias must be [features] in the model's dtype");
      }
      for (int64_t j = p; j < p + 4; ++j) {
        const int64_t k_len = in_features(j), n_out = outs_[j];
        switch (kinds_[j]) {
          case kProjectDense: check_dense_packed(packed_[j], in_type(j), k_len, n_out); break;
          case kProjectInt8Vnni: check_int8_vnni_packed(packed_[j], scales_[j], k_len, n_out); break;
          case kProjectInt4Vnni: check_int4_vnni_packed(packed_[j], groups_[j], k_len, n_out); break;
          default: TORCH_CHECK(false, "unknown projection kind");
        }
        widest_ = std::max(widest_, n_out);
      }
    }
  }

  int64_t num_layers() const { return layers_; }

  // x [T, hidden] (the embeddings, added to in place as the loop's norms add), positions [T], the model's RoPE
  // tables; each layer's K and V pools (and an int8 pool's scales), this step's slot mapping and its attention's slot
  // lists, lengths and (prefill rows) lists, as attention/sdpa.py's metadata holds them; per layer the key smoothing
  // of an int8 pool (query and key_inverse) or none. Returns (x, the last MLP's output): what the final norm adds.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                         const at::Tensor& positions, const std::vector<at::Tensor>& k_pools,
                                         const std::vector<at::Tensor>& v_pools,
                                         const std::vector<at::Tensor>& k_scales,
                                         const std::vector<at::Tensor>& v_scales, const at::Tensor& slot_mapping,
                                         const at::Tensor& slots, const at::Tensor& lens,
                                         const c10::optional<at::Tensor>& lists,
                                         const std::vector<at::Tensor>& query_scales,
                                         const std::vector<at::Tensor>& key_inverses) const {
    const size_t n = static_cast<size_t>(layers_);
    const bool int8_pool = !k_scales.empty(), smoothed = !query_scales.empty();
    TORCH_CHECK(k_pools.size() == n && v_pools.size() == n && (!int8_pool || (k_scales.size() == n &&
                v_scales.size() == n)) && (!smoothed || (query_scales.size() == n && key_inverses.size() == n)),
                "a pool (and an int8 pool's scales, and key scales where given) for each of the ", n, " layers");
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == dtype_ && x.dim() == 2 && x.size(1) == hidden_ &&
                    x.size(0) > 0 && x.is_contiguous(),
                "x must be a contiguous [T, hidden] tensor in the model's dtype, T > 0");
    const int64_t tokens = x.size(0), D = head_dim_, KV = kv_heads_, H = heads_;
    const int64_t q_size = H * D, kv_size = KV * D, qkv_size = q_size + 2 * kv_size;
    TORCH_CHECK(cos.scalar_type() == dtype_ && cos.dim() == 2 && cos.is_contiguous() && cos.size(1) == D &&
                    sin.sizes() == cos.sizes() && sin.scalar_type() == dtype_ && sin.is_contiguous(),
                "cos and signed_sin must be contiguous [L, head_dim] tables in the model's dtype");
    const int64_t* pos = check_indices(positions, tokens, cos.size(0), "positions", "a position is past the table");
    const int64_t pool_slots = k_pools[0].size(0);
    for (size_t i = 0; i < n; ++i) {
      c10::optional<at::Tensor> ks, vs;
      if (int8_pool) {
        ks = k_scales[i];
        vs = v_scales[i];
      }
      check_pools(k_pools[i], v_pools[i], KV, D, dtype_, "the model's dtype", ks, vs);
      TORCH_CHECK(k_pools[i].size(0) == pool_slots, "every layer's pools must have the first layer's slots");
      if (smoothed) {
        for (const auto& [scale, rows] : {std::pair{query_scales[i], H}, std::pair{key_inverses[i], KV}}) {
          TORCH_CHECK(scale.scalar_type() == dtype_ && scale.is_contiguous() && scale.dim() == 2 &&
                          scale.size(0) == rows && scale.size(1) == D,
                      "key smoothing's scales must be contiguous [heads, head_dim] in the model's dtype");
        }
      }
    }
    const int64_t* sm = check_indices(slot_mapping, tokens, pool_slots, "slot_mapping", "a slot is past the pool");
    const int64_t* listp = check_slot_lists(slots, lens, lists, tokens);
    const int64_t* lp = lens.data_ptr<int64_t>();

    // the step's intermediates, each [T, features] at 4 bytes an element at most, 64-byte aligned, in one buffer
    char *h, *qkv, *biased, *v_own, *rotated, *q_smooth, *k_smooth, *attended, *o, *gate_up, *act, *residual, *wide;
    const std::pair<char**, int64_t> parts[] = {
        {&h, hidden_}, {&qkv, qkv_size}, {&biased, qkv_size}, {&v_own, kv_size}, {&rotated, q_size + kv_size},
        {&q_smooth, q_size}, {&k_smooth, kv_size}, {&attended, q_size}, {&o, hidden_}, {&gate_up, widest_},
        {&act, widest_}, {&residual, hidden_},
        {&wide, widest_}};  // a weight-only kernel's float32 sums for a bf16 input
    auto bytes = [&](int64_t features) { return (tokens * features * 4 + 63) / 64 * 64; };
    int64_t total = 64;
    for (const auto& part : parts) total += bytes(part.second);
    at::Tensor buffer = at::empty({total}, x.options().dtype(at::kByte));
    char* next = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(buffer.data_ptr()) + 63) & ~uintptr_t{63});
    for (const auto& [at, features] : parts) {
      *at = next;
      next += bytes(features);
    }
    at::Tensor last = at::empty({tokens, hidden_}, x.options().dtype(in_type(4 * layers_ - 1)));

    const at::ScalarType X = dtype_;
    const int64_t rot_row = q_size + kv_size;
    at::ScalarType residual_type = at::ScalarType::Undefined;
    const char* residual_in = nullptr;
    for (int64_t i = 0; i < layers_; ++i) {
      const int64_t p = 4 * i;
      const at::ScalarType h_type = in_type(p);
      add_rms_norm_into(X, x.data_ptr(), residual_type, residual_in, norms_[2 * i].data_ptr(), h_type, h, tokens,
                        hidden_, static_cast<float>(eps_));
      project(p, h_type, h, tokens, qkv, wide);
      at::ScalarType qkv_type = h_type;
      const char* qkv_out = qkv;
      if (has(qkv_bias_[i])) {
        const at::ScalarType sum_type = promoted(h_type, X);
        elementwise(h_type, qkv, qkv_size, X, qkv_bias_[i].data_ptr(), 0, sum_type, biased, tokens, qkv_size,
                    std::plus<float>());
        qkv_type = sum_type;
        qkv_out = biased;
      }
      const int64_t qkv_bytes = at::elementSize(qkv_type);
      Rows3 v{qkv_out + (q_size + kv_size) * qkv_bytes, qkv_size, D};  // qkv[:, q + kv:] as [T, KV, D]
      if (qkv_type != X) {  // the loop's v.to(dtype): bf16 into float32, exactly
        elementwise(qkv_type, v.p, qkv_size, X, nullptr, 0, X, v_own, tokens, kv_size,
                    [](float a, float) { return a; });
        v = {v_own, kv_size, D};
      }
      rope_into(qkv_type, qkv_out, qkv_size, D, X, cos.data_ptr(), sin.data_ptr(), pos, rotated, tokens, H + KV, D);
      const int64_t x_bytes = at::elementSize(X);
      Rows3 q{rotated, rot_row, D}, k{rotated + q_size * x_bytes, rot_row, D};
      if (smoothed) {  // q * query, k * key_inverse, [heads, D] each broadcast over the rows
        for (int64_t t = 0; t < tokens; ++t) {
          elementwise(X, static_cast<const char*>(q.p) + t * rot_row * x_bytes, D, X, query_scales[i].data_ptr(), D,
                      X, q_smooth + t * q_size * x_bytes, H, D, std::multiplies<float>());
          elementwise(X, static_cast<const char*>(k.p) + t * rot_row * x_bytes, D, X, key_inverses[i].data_ptr(), D,
                      X, k_smooth + t * kv_size * x_bytes, KV, D, std::multiplies<float>());
        }
        q = {q_smooth, q_size, D};
        k = {k_smooth, kv_size, D};
      }
      float* ks = int8_pool ? k_scales[i].data_ptr<float>() : nullptr;
      float* vs = int8_pool ? v_scales[i].data_ptr<float>() : nullptr;
      write_kv_into(X, k, v, tokens, KV, D, sm, k_pools[i].data_ptr(), v_pools[i].data_ptr(), ks, vs);
      attend({X, q.p, q.row_stride, q.head_stride, tokens, H, D, KV, k_pools[i].data_ptr(), v_pools[i].data_ptr(), ks,
              vs, slots.data_ptr<int64_t>(), lp, listp, slots.size(1), attended});
      project(p + 1, X, attended, tokens, o, wide);
      if (has(o_bias_[i])) {
        elementwise(X, o, hidden_, X, o_bias_[i].data_ptr(), 0, X, o, tokens, hidden_, std::plus<float>());
      }
      const at::ScalarType up_type = in_type(p + 2), act_type = in_type(p + 3);
      add_rms_norm_into(X, x.data_ptr(), X, o, norms_[2 * i + 1].data_ptr(), up_type, h, tokens, hidden_,
                        static_cast<float>(eps_));
      project(p + 2, up_type, h, tokens, gate_up, wide);
      silu_mul_into(up_type, gate_up, X, act_type, act, tokens, outs_[p + 2] / 2);
      char* down = i + 1 == layers_ ? static_cast<char*>(last.data_ptr()) : residual;
      project(p + 3, act_type, act, tokens, down, wide);
      residual_type = act_type;
      residual_in = down;
    }
    return {x, last};
  }

 private:
  static bool has(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

  // what projection p takes (and, as the loop's `raw`, returns): bf16 where the step before hands it bf16, else the
  // model's dtype (the attention's output, into o, is always the model's)
  at::ScalarType in_type(int64_t p) const { return bf16_in_[p] ? at::kBFloat16 : dtype_; }

  int64_t in_features(int64_t p) const {
    switch (p % 4) {
      case 1: return heads_ * head_dim_;
      case 3: return outs_[p - 1] / 2;
      default: return hidden_;
    }
  }

  // y [m, outs] of x's type = x [m, K] (contiguous) @ W.T, by projection p's kernel; a weight-only kernel's float32
  // sums cast to bf16 for a bf16 x (quant/linear.py's `raw`), through `wide`
  void project(int64_t p, at::ScalarType x_type, const void* x, int64_t m, void* y, char* wide) const {
    const int64_t k_len = in_features(p), n = outs_[p];
    if (kinds_[p] == kProjectDense) {
      dense_into(x_type, x, k_len, packed_[p].data_ptr(), m, k_len, n, y);
      return;
    }
    float* sums = static_cast<float*>(x_type == at::kFloat ? y : static_cast<void*>(wide));
    if (kinds_[p] == kProjectInt8Vnni) {
      int8_vnni_into(x_type, x, m, k_len, packed_[p].data_ptr(), scales_[p].data_ptr<float>(), n, sums);
    } else {
      int4_vnni_into(x_type, x, m, k_len, packed_[p].data_ptr(), groups_[p], n, sums);
    }
    if (x_type != at::kFloat) {
      c10::BFloat16* out = static_cast<c10::BFloat16*>(y);
      for (int64_t e = 0; e < m * n; ++e) out[e] = c10::BFloat16(sums[e]);
    }
  }

  std::vector<at::Tensor> norms_;
  std::vector<int64_t> kinds_;
  std::vector<at::Tensor> packed_, scales_;
  std::vector<int64_t> groups_, outs_;
  std::vector<bool> bf16_in_;
  std::vector<at::Tensor> qkv_bias_, o_bias_;
  int64_t layers_, heads_, kv_heads_, head_dim_, hidden_ = 0, widest_ = 0;
  double eps_;
  at::ScalarType dtype_;
};

// ---- The sampler's row work (engine/sampler.py) over a step's float32 logits [rows, vocabulary]: each row in one
// or two passes, where torch's calls cost several full passes and fresh tensors each (a topk over 49k entries took
// ~150 us a row on 2 cores; a softmax, a boolean mask and a masked fill each a few milliseconds for 32 rows).
namespace {
constexpr int64_t kSampleRowsPerTask = 1;

// the first index of the row's maximum; the first NaN where there is one (as torch's argmax and max(dim) give)
int64_t argmax_row(const float* x, int64_t n) {
  float top = -INFINITY;
  bool nan = false;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 tv = _mm512_set1_ps(-INFINITY);
  __mmask16 any_nan = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    any_nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    tv = _mm512_max_ps(tv, v);
  }
  nan = any_nan != 0;
  top = _mm512_reduce_max_ps(tv);
#endif
  for (; j < n; ++j) {
    nan = nan || std::isnan(x[j]);
    top = std::max(top, x[j]);
  }
  for (j = 0; j < n; ++j) {
    if (nan ? std::isnan(x[j]) : x[j] == top) return j;
  }
  return 0;  // a row of -inf only: its first entry, as argmax gives
}

// the row's maximum (-inf for an empty row; NaN propagation as _mm512_max_ps / std::max give it)
inline float row_max(const float* x, int64_t n) {
  float top = -INFINITY;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 tv = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) tv = _mm512_max_ps(tv, _mm512_loadu_ps(x + i));
  top = _mm512_reduce_max_ps(tv);
#endif
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

#if defined(__AVX512F__)
// exp(v - m) on 16 lanes, exactly 0 where v is -inf (a dropped token): fast_exp's own floor would give it ~1e-38
inline __m512 exp_or_zero16(__m512 v, __m512 m) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                             exp16(_mm512_sub_ps(v, m)));
}
#endif

// The tokens a row's filters keep, as a full sort would decide them, over e[i] = exp(x[i] - max): the tempered
// probabilities times the row's sum, each in (0, 1]. Ties are broken by token id (a sort's order is not defined for
// them). Three ways, each only where a filter needs it:
// - min-p: e[i] >= min_p (p_i >= min_p * p_max), no sort at all;
// - the candidates, e >= kCandidate (a logit within ~8.3 of the row's top), gathered in the exponentials' own
//   vector pass: a language model's next token nearly always lies among a few hundred of them, and a filter whose
//   boundary falls among them (top-k: at least k of them; top-p: their mass reaches p) is settled by them alone,
//   exactly as a full sort settles it (every other token is less likely than all of them): top-k by nth_element,
//   top-p by sorting them;
// - otherwise (a flat row, a k past the candidates, a p near 1) buckets of e's float bits (exponent and three bits of
//   mantissa: 1,024 buckets, each a factor of 2^(1/8) wide) counted and summed in one pass, the boundary's bucket
//   found from the top and only its members ranked.
constexpr float kCandidate = 1.f / 4096.f;
constexpr int kBuckets = 1024;
constexpr int64_t kMostSorted = 4096;  // candidates sorted for top-p at most; more: the buckets

using Ranked = std::vector<std::pair<float, int64_t>>;

inline bool before_in_rank(const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& c) {
  return a.first > c.first || (a.first == c.first && a.second < c.second);  // most likely first; ties: lower id
}

inline int bucket_of(float e) {
  uint32_t bits;
  std::memcpy(&bits, &e, sizeof bits);
  return static_cast<int>(bits >> 20);  // e in [0, 1]: 0 ... 1016
}

struct Buckets {
  std::vector<double> mass = std::vector<double>(kBuckets, 0.0);
  std::vector<int64_t> count = std::vector<int64_t>(kBuckets, 0);
  explicit Buckets(const float* e, int64_t n) {
    std::vector<double> odd(kBuckets, 0.0);  // two sums a bucket: half the chains of dependent additions
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      const int a = bucket_of(e[j]), b = bucket_of(e[j + 1]);
      mass[a] += e[j];
      odd[b] += e[j + 1];
      count[a] += 1;
      count[b] += 1;
    }
    if (j < n) {
      mass[bucket_of(e[j])] += e[j];
      count[bucket_of(e[j])] += 1;
    }
    for (int k = 0; k < kBuckets; ++k) mass[k] += odd[k];
  }
};

Ranked bucket_members(const float* e, int64_t n, int b) {
  Ranked members;
  for (int64_t i = 0; i < n; ++i) {
    if (bucket_of(e[i]) == b) members.emplace_back(e[i], i);
  }
  return members;
}

// (threshold e, last id kept at it) of the k-th most likely
std::pair<float, int64_t> kth_most_likely(Ranked& cand, const float* e, int64_t n, int64_t k) {
  if (static_cast<int64_t>(cand.size()) >= k) {
    std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), before_in_rank);
    return cand[k - 1];
  }
  const Buckets h(e, n);
  int64_t seen = 0;
  int b = kBuckets - 1;
  for (; b > 0 && seen + h.count[b] < k; --b) seen += h.count[b];
  Ranked members = bucket_members(e, n, b);
  const int64_t at = std::min<int64_t>(k - seen, members.size()) - 1;
  std::nth_element(members.begin(), members.begin() + at, members.end(), before_in_rank);
  return members[at];
}

// (threshold e, last id kept at it) of the token that crosses p; (0, n): nothing dropped (p not reached in rounding)
std::pair<float, int64_t> top_p_boundary(Ranked& cand, double cand_mass, const float* e, int64_t n, double want) {
  double before = 0.0;
  Ranked members;
  if (cand_mass >= want && static_cast<int64_t>(cand.size()) <= kMostSorted) {
    members.swap(cand);
  } else {
    const Buckets h(e, n);
    int b = kBuckets - 1;
    for (; b > 0 && before + h.mass[b] < want; --b) before += h.mass[b];
    members = bucket_members(e, n, b);
  }
  std::sort(members.begin(), members.end(), before_in_rank);
  for (const auto& [value, id] : members) {
    if (before + value >= want) return {value, id};  // the token that crosses p: the last one kept
    before += value;
  }
  return members.empty() ? std::make_pair(0.f, n) : members.back();
}

void filter_row(float* x, float* e, int64_t n, int64_t top_k, float top_p, float min_p) {
  const bool use_k = top_k > 0 && top_k < n, use_p = top_p < 1.f, use_m = min_p > 0.f;
  if (!use_k && !use_p && !use_m) return;
  const float top = row_max(x, n);
  if (!std::isfinite(top)) return;  // nothing to judge (every entry -inf, or NaN): left as it is
  int64_t i = 0;
  const bool gather = use_k || use_p;
  Ranked cand;
  double total = 0.0, cand_mass = 0.0;
  i = 0;
#if defined(__AVX512F__)
  {
    std::vector<float> cv(gather ? n : 0);
    std::vector<int32_t> ci(gather ? n : 0);
    int64_t nc = 0;
    const __m512 m = _mm512_set1_ps(top), floor = _mm512_set1_ps(kCandidate);
    __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    while (i + 16 <= n) {  // chunks of up to 256 summed in float, the chunks in double
      __m512 part = _mm512_setzero_ps();
      for (int c = 0; c < 16 && i + 16 <= n; ++c, i += 16, ids = _mm512_add_epi32(ids, step)) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512 ev = exp_or_zero16(v, m);
        _mm512_storeu_ps(e + i, ev);
        part = _mm512_add_ps(part, ev);
        if (gather) {
          const __mmask16 keep = _mm512_cmp_ps_mask(ev, floor, _CMP_GE_OQ);
          _mm512_mask_compressstoreu_ps(cv.data() + nc, keep, ev);
          _mm512_mask_compressstoreu_epi32(ci.data() + nc, keep, ids);
          nc += __builtin_popcount(keep);
        }
      }
      total += _mm512_reduce_add_ps(part);
    }
    cand.reserve(nc + 16);
    for (int64_t c = 0; c < nc; ++c) cand.emplace_back(cv[c], ci[c]);
  }
#endif
  for (; i < n; ++i) {
    e[i] = x[i] == -INFINITY ? 0.f : fast_exp(x[i] - top);
    total += e[i];
    if (gather && e[i] >= kCandidate) cand.emplace_back(e[i], i);
  }
  for (const auto& c : cand) cand_mass += c.first;
  // each filter as (threshold e, last id kept at that value): a token is kept when it is more likely than the
  // threshold, or as likely and not after the last id kept
  float k_at = 0.f, p_at = 0.f;
  int64_t k_last = n, p_last = n;
  if (use_p) {  // first: kth_most_likely reorders the candidates
    Ranked mine = use_k ? cand : Ranked();
    std::tie(p_at, p_last) = top_p_boundary(use_k ? mine : cand, cand_mass, e, n, static_cast<double>(top_p) * total);
  }
  if (use_k) std::tie(k_at, k_last) = kth_most_likely(cand, e, n, top_k);
  int64_t j = 0;
#if defined(__AVX512F__)
  {
    const __m512 mv = _mm512_set1_ps(use_m ? min_p : 0.f), kv = _mm512_set1_ps(use_k ? k_at : 0.f),
                 pv = _mm512_set1_ps(use_p ? p_at : 0.f);
    const __m512i k_last_v = _mm512_set1_epi32(static_cast<int32_t>(std::min<int64_t>(k_last, INT32_MAX))),
                  p_last_v = _mm512_set1_epi32(static_cast<int32_t>(std::min<int64_t>(p_last, INT32_MAX)));
    const __m512 lowest = _mm512_set1_ps(-INFINITY);
    __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; j + 16 <= n; j += 16, ids = _mm512_add_epi32(ids, _mm512_set1_epi32(16))) {
      const __m512 v = _mm512_loadu_ps(e + j);
      __mmask16 drop = _mm512_cmp_ps_mask(v, mv, _CMP_LT_OQ);  // min_p 0 (off) drops nothing
      if (use_k) {
        drop |= _mm512_cmp_ps_mask(v, kv, _CMP_LT_OQ) |
                (_mm512_cmp_ps_mask(v, kv, _CMP_EQ_OQ) & _mm512_cmpgt_epi32_mask(ids, k_last_v));
      }
      if (use_p) {
        drop |= _mm512_cmp_ps_mask(v, pv, _CMP_LT_OQ) |
                (_mm512_cmp_ps_mask(v, pv, _CMP_EQ_OQ) & _mm512_cmpgt_epi32_mask(ids, p_last_v));
      }
      _mm512_mask_storeu_ps(x + j, drop, lowest);
    }
  }
#endif
  for (; j < n; ++j) {
    const float v = e[j];
    const bool drop = (use_m && v < min_p) || (use_k && (v < k_at || (v == k_at && j > k_last))) ||
                      (use_p && (v < p_at || (v == p_at && j > p_last)));
    if (drop) x[j] = -INFINITY;
  }
}
}  // namespace

// x [T, V] float32, in place: exp(x - the row's max), 0 where x is -inf (a filtered token), each row's masses up to a
// scale (what the draw's inversion needs). torch's exp_ takes a slow path below ~-87: 8 ms for 32 rows of -inf, 60 ms
// at -100, against 0.7 ms in range; here fast_exp's floor (~1e-38) stands for what underflows, and a filtered token
// gets exactly 0. A row without a finite maximum (NaN, or all -inf) is left as it is.
at::Tensor exp_shifted_rows(at::Tensor x) {
  check(x, 2, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  float* xp = x.data_ptr<float>();
  pool::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = xp + t * n;
      const float top = row_max(r, n);
      if (!std::isfinite(top)) continue;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 m = _mm512_set1_ps(top);
      for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(r + i);
        _mm512_storeu_ps(r + i, exp_or_zero16(v, m));
      }
#endif
      for (; i < n; ++i) r[i] = r[i] == -INFINITY ? 0.f : fast_exp(r[i] - top);
    }
  });
  return x;
}

namespace {
constexpr int64_t kCdfChunk = 256;  // sampler.py's CDF_CHUNK: the two levels of the inversion

// the float32 sum of a chunk (16 lanes, then across them: the order torch's vectorized sum also takes, to an ulp)
inline float chunk_sum(const float* p, int64_t len) {
  int64_t i = 0;
  float mass = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= len; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + i));
  mass = _mm512_reduce_add_ps(acc);
#endif
  for (; i < len; ++i) mass += p[i];
  return mass;
}

// one row of probabilities up to a scale (>= 0, at least one > 0), u in [0, 1): the first token whose cumulative
// mass exceeds u x the row's total, as sampler.py's invert_cdf finds it (chunk masses summed in float32 and
// accumulated in float64 to pick the chunk, a float32 running sum inside it)
int64_t invert_cdf_row(const float* p, int64_t n, double u) {
  const int64_t chunks = (n + kCdfChunk - 1) / kCdfChunk;
  std::vector<float> masses(chunks);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    masses[c] = chunk_sum(p + c * kCdfChunk, std::min(kCdfChunk, n - c * kCdfChunk));
    total += masses[c];
  }
  const double target = u * total;
  double before = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const float mass = masses[c];
    if (before + mass > target) {
      const int64_t lo = c * kCdfChunk, hi = std::min(n, lo + kCdfChunk);
      float inner = 0.f;  // the chunk's running sum, as a cumulative sum gives it
      for (int64_t i = lo; i < hi; ++i) inner += p[i];
      // where u falls inside the chunk, on the scale of the chunk's own running sum
      const float rest = static_cast<float>((target - before) / static_cast<double>(mass) * inner);
      float run = 0.f;
      int64_t last = lo;  // the chunk's last token with mass so far
      for (int64_t i = lo; i < hi; ++i) {
        run += p[i];
        if (p[i] > 0.f) last = i;
        if (run > rest) return last;  // i itself: a token without mass adds no width, so none is crossed there
      }
      return last;  // a rest rounded up to the chunk's whole mass: its last token with mass
    }
    before += mass;
  }
  for (int64_t i = n - 1; i >= 0; --i)  // u x total rounded up to the total: the last token with mass
    if (p[i] > 0.f) return i;
  return 0;
}
}  // namespace

// logits [T, V] float32 -> int64 [T]: each row's argmax (the first of equal maxima; the first NaN)
at::Tensor argmax_rows(const at::Tensor& logits) {
  check(logits, 2, "logits");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  pool::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) op[t] = argmax_row(xp + t * n, n);
  });
  return out;
}

// processed logits [T, V] float32 (the caller's to give away), uniform [T] float64 in [0, 1) -> int64 [T]: each
// row's exp(x - max) in place (exp_shifted_rows), then the token where u falls (invert_cdf_row): sampler.py's
// draw for the sampled rows in one call
at::Tensor draw_rows(at::Tensor x, const at::Tensor& uniform) {
  check(x, 2, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(uniform.device().is_cpu() && uniform.scalar_type() == at::kDouble && uniform.is_contiguous() &&
                  uniform.numel() == rows,
              "uniform must hold one float64 per row");
  TORCH_CHECK(n > 0, "x must have at least one column");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  float* xp = x.data_ptr<float>();
  const double* up = uniform.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  pool::parallel_for(0, rows, kSampleRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = xp + t * n;
      const float top = row_max(r, n);
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 m = _mm512_set1_ps(top);
      for (; i + 16 <= n; i += 16) _mm512_storeu_ps(r + i, exp_or_zero16(_mm512_loadu_ps(r + i), m));
#endif
      for (; i < n; ++i) r[i] = r[i] == -INFINITY ? 0.f : fast_exp(r[i] - top);
      op[t] = invert_cdf_row(r, n, up[t]);
    }
  });
  return out;
}

// logits [T, V] float32 (tempered), in place: what top-k (top_k [T] int64, <= 0 or >= V: off), top-p (top_p [T]
// float32, 1: off) and min-p (min_p [T] float32, 0: off) drop set to -inf, each judging the row's softmax as it is
at::Tensor filter_rows(at::Tensor logits, const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p) {
  check(logits, 2, "logits");
  check(top_p, 1, "top_p");
  check(min_p, 1, "min_p");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.dim() == 1 && top_k.is_contiguous() && top_k.size(0) == rows &&
                  top_p.size(0) == rows && min_p.size(0) == rows,
              "top_k (int64), top_p and min_p must hold one value per row");
  float* xp = logits.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const float* pp = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  pool::parallel_for(0, rows, kSampleRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> e(n);
    for (int64_t t = begin; t < end; ++t) filter_row(xp + t * n, e.data(), n, kp[t], pp[t], mp[t]);
  });
  return logits;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Each kernel lets go of the GIL while it computes, as torch's own operators do: the server's event loop and the
  // page's threads run their Python meanwhile instead of waiting for the step (the kernels touch no Python object).
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("quantize_rows", &quantize_rows, nogil, "w8a8's activations, quantized per row");
  m.def("dequantize_rows", &dequantize_rows, nogil, "int32 sums scaled back per row, in place");
  m.def("decode_attention", &decode_attention, nogil, "one query per row against its slots of the paged KV pool",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("slots"), py::arg("lens"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::arg("lists") = py::none());
  m.def("write_kv", &write_kv, nogil, "this step's K and V into the pool: as they are, or quantized into an int8 pool",
        py::arg("k"), py::arg("v"), py::arg("slots"), py::arg("k_pool"), py::arg("v_pool"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("add_rms_norm", &add_rms_norm, nogil, "x += residual in place (when given), then RMSNorm(x) * weight",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("dtype") = py::none());
  m.def("weight_only_available", &weight_only_available, "whether int8_matmul and int4_matmul are built (AVX-512)");
  m.def("int8_matmul", &int8_matmul, nogil, "x @ (q * scale).T, int8 weights widened as they are read");
  m.def("dense_dtypes", &dense_dtypes, "the dtypes dense_matmul runs in this build");
  m.def("dense_amx", &dense_amx, "whether dense_matmul's bf16 runs on AMX here (K a multiple of 32)");
  m.def("pack_dense", &pack_dense, nogil, "a [N, K] weight packed for dense_matmul (once, at load)");
  m.def("dense_matmul", &dense_matmul, nogil, "x @ W.T in x's dtype over pack_dense's weight", py::arg("x"),
        py::arg("packed"), py::arg("n"));
  m.def("int4_matmul", &int4_matmul, nogil, "x @ W.T, W int4 in groups (scale, mid), widened as it is read");
  m.def("vnni_available", &vnni_available, "whether int4_matmul_vnni and int8_matmul_vnni are built "
        "(AVX-512 VNNI)");
  m.def("int8_matmul_vnni", &int8_matmul_vnni, nogil, "x @ (q * scale).T, x in two 8-bit parts per 32 features, on "
        "VNNI's integer dot products", py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("n"));
  m.def("int4_matmul_vnni", &int4_matmul_vnni, nogil, "x @ W.T, W int4 in groups, x in two 8-bit parts per 32 "
        "features, on VNNI's integer dot products", py::arg("x"), py::arg("packed"), py::arg("group"), py::arg("n"));
  m.def("rope", &rope, nogil, "rotary embedding of q and k by their positions");
  m.def("exp_shifted_rows", &exp_shifted_rows, nogil, "exp(x - row max) in place, 0 where x is -inf");
  m.def("draw_rows", &draw_rows, nogil, "exp(x - row max) in place, then each row's token at its uniform number");
  m.def("argmax_rows", &argmax_rows, nogil, "each row's argmax (the first of equal maxima, the first NaN)");
  m.def("filter_rows", &filter_rows, nogil, "top-k / top-p / min-p of tempered logits, in place (dropped: -inf)");
  m.def("kernel_threads", &kernel_threads, "the kernels' threads: n > 0 sets them (capped by the usable cores), 0 "
        "follows torch.get_num_threads(), negative leaves it; returns the count a call uses", py::arg("n") = -1);
  m.def("kernel_spin_us", &kernel_spin_us, "how long an idle kernel thread waits for work before it sleeps "
        "(microseconds; negative: unchanged); returns it", py::arg("us") = -1);
  m.def("kernel_yield_us", &kernel_yield_us, "after that spin, how long an idle kernel thread goes on checking "
        "between sched_yield calls before it sleeps (microseconds; default 0; negative: unchanged); returns it",
        py::arg("us") = -1);
  m.def("pool_stats", &pool_stats, "the kernels' threads: workers started, chunks they ran, claims refused, holds, "
        "the count set; regions run on several threads and alone, ns in each, the callers' ns waiting at their "
        "ends for a worker's chunk (waits over 50 us and 1 ms, the longest since the last call), worker sleeps");
  m.def("pool_hold", &pool_hold, "tests: stop every worker between reading a job and claiming a chunk (or let go)");
  m.def("pool_runs", &pool_runs, nogil, "tests: which thread ran each of [0, items), and in what order",
        py::arg("items"), py::arg("work_us"));
  m.def("pool_count", &pool_count, nogil, "tests: how many times each of [0, items) ran through the pool",
        py::arg("items"), py::arg("grain"), py::arg("work_us") = 0);
  py::class_<DecoderStack>(m, "DecoderStack", "a step's decoder layers in one call, over the layers' weights")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<int64_t>, std::vector<int64_t>, std::vector<bool>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, int64_t, int64_t, int64_t, double, at::ScalarType>(),
           py::arg("norms"), py::arg("kinds"), py::arg("packed"), py::arg("scales"), py::arg("groups"),
           py::arg("outs"), py::arg("bf16_in"), py::arg("qkv_bias"), py::arg("o_bias"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("dtype"))
      .def_property_readonly("num_layers", &DecoderStack::num_layers)
      .def("run", &DecoderStack::run, nogil, "every layer of a step: (x, the last MLP's output)", py::arg("x"),
           py::arg("cos"), py::arg("sin"), py::arg("positions"), py::arg("k_pools"), py::arg("v_pools"),
           py::arg("k_scales"), py::arg("v_scales"), py::arg("slot_mapping"), py::arg("slots"), py::arg("lens"),
           py::arg("lists"), py::arg("query_scales"), py::arg("key_inverses"));
  m.def("silu_mul", &silu_mul, nogil, "silu(gate) * up of a joined gate|up projection", py::arg("gate_up"),
        py::arg("dtype"), py::arg("out_dtype") = py::none());
}
