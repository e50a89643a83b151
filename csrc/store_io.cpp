// Native data path of the KV block store (pybind11 module ucm.store._native).
//
// Python decides *which* files to touch (layout, eviction, stats); this file
// does the byte work: the block file format, XXH64 checksums (xxHash) and a small
// thread pool that reads and writes many blocks with the GIL released.
//
// Block file layout (all integers little endian):
//   [0, 8)      magic "UCMKVBLK"
//   [8, 12)     u32 length of the msgpack header that follows
//   [12, ...)   msgpack map {version, payload_offset, payload_len,
//               token_count, xxh64, key, header_xxh64[, segments]}, zero padded to 4096 bytes
// Version 1: xxh64 covers the payload. Version 2 (a payload of several equal segments, e.g. one per
// model layer, each readable and verifiable alone): `segments` lists each segment's XXH64 and
// xxh64 is the XXH64 of that list (u64 LE each). header_xxh64 covers every other header field
// (header_digest), so a damaged token_count, key or segment list is detected like a damaged payload.
//   [4096, ...) payload (exactly payload_len bytes)
// The payload starts at 4096 so that O_DIRECT can read it into an aligned
// destination without a bounce copy.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"

namespace py = pybind11;

namespace ucm {

// XXH64 checksums: xxHash's reference implementation (csrc/third_party/xxhash, v0.8, BSD-2-Clause),
// inlined. Verifying loads is the only hot use: ~7 GB/s per core here, about 2 s of a 570 s RAG
// stream that reads 11.8 GB (docs/research.md), so no SIMD variant of our own is kept.
class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0) { XXH64_reset(&state_, seed); }
  void update(const void* data, size_t len) { XXH64_update(&state_, data, len); }
  uint64_t digest() const { return XXH64_digest(&state_); }

 private:
  XXH64_state_t state_;
};

uint64_t xxh64_of(const void* data, size_t len) {
  Xxh64 hash(0);
  hash.update(data, len);
  return hash.digest();
}

// The XXH64 of each of `count` equal segments of `data` (version 2's `segments`).
std::vector<uint64_t> segment_digests(const uint8_t* data, size_t len, size_t count) {
  std::vector<uint64_t> out;
  const size_t seg = len / count;
  for (size_t i = 0; i < count; ++i) out.push_back(xxh64_of(data + i * seg, seg));
  return out;
}


// ---------------------------------------------------------------------------
// Block format
// ---------------------------------------------------------------------------
constexpr char kMagic[8] = {'U', 'C', 'M', 'K', 'V', 'B', 'L', 'K'};
constexpr size_t kPrefixSize = 12;        // magic + u32 header length
constexpr size_t kHeaderRegion = 4096;    // payload offset
constexpr uint64_t kFormatVersion = 1;           // one checksum over the payload
constexpr uint64_t kSegmentedVersion = 2;        // a checksum per segment
constexpr size_t kMaxSegments = 256;             // their checksums fit the header region
constexpr size_t kAlign = 4096;           // O_DIRECT buffer/offset/length alignment
constexpr size_t kChunk = 256 * 1024;     // bounce for an O_DIRECT read's unaligned tail
// Most payload bytes one read or write call moves. A network file system (NFS, FUSE) sends one
// large call as requests in flight together where it can (O_DIRECT reads, NFS writes), and a
// sequence of small calls waits one round trip each.
constexpr size_t kIoUnit = 8 << 20;
// Lookups stat in parallel: on NFS each stat of an uncached name is a round trip to the server
// per path component, so a request's stats would otherwise queue one behind the other. Starting a
// thread costs tens of microseconds, which a local directory's stats (microseconds) do not repay
// and a server's round trips (milliseconds) repay many times over: each thread gets enough paths
// for about kStatThreadWorkNs of stats, by the cost per stat the last lookup measured.
constexpr size_t kStatThreads = 64;
constexpr int64_t kStatThreadWorkNs = 200000;
constexpr size_t kStatsPerThreadUnmeasured = 4;

enum Status : int {
  kOk = 0,
  kNotFound = 1,
  kBadHeader = 2,
  kLengthMismatch = 3,
  kChecksumMismatch = 4,
  kIoError = 5,
  kTruncated = 6,
  kExists = 7,  // dump: the final file was already there, nothing written
  kUnsupportedVersion = 8,  // written by another format version; left alone (rolling upgrades)
  kNotSegmented = 9,  // a segment read of a block stored without those segments; left alone
};

struct BlockHeader {
  uint64_t version = 0;
  uint64_t payload_offset = 0;
  uint64_t payload_len = 0;
  uint64_t token_count = 0;
  uint64_t checksum = 0;
  std::string key;
  uint64_t header_checksum = 0;
  std::vector<uint64_t> segments;  // version 2: each segment's XXH64
};

// XXH64 of a list of segment checksums (version 2's xxh64 field).
uint64_t segments_digest(const std::vector<uint64_t>& segments) {
  Xxh64 hash(0);
  for (uint64_t d : segments) {
    uint8_t le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<uint8_t>((d >> (8 * i)) & 0xff);
    hash.update(le, sizeof(le));
  }
  return hash.digest();
}

// XXH64 of the header's other fields: five u64 LE (version, payload_offset, payload_len,
// token_count, xxh64), then the key bytes (ucm/store/block_format.py computes the same).
uint64_t header_digest(const BlockHeader& h);

class MsgpackWriter {
 public:
  void map_header(uint32_t n) { container(0x80, 0xde, n); }
  void array_header(uint32_t n) { container(0x90, 0xdc, n); }
  void str(std::string_view s) {  // keys are short literals
    out_.push_back(static_cast<char>(0xa0 | s.size()));
    out_.append(s);
  }
  void uint(uint64_t v) {
    if (v < 128) {
      out_.push_back(static_cast<char>(v));
    } else if (v <= 0xff) {
      out_.push_back(static_cast<char>(0xcc));
      be(v, 1);
    } else if (v <= 0xffff) {
      out_.push_back(static_cast<char>(0xcd));
      be(v, 2);
    } else if (v <= 0xffffffffULL) {
      out_.push_back(static_cast<char>(0xce));
      be(v, 4);
    } else {
      out_.push_back(static_cast<char>(0xcf));
      be(v, 8);
    }
  }
  void bin(std::string_view b) {
    if (b.size() <= 0xff) {
      out_.push_back(static_cast<char>(0xc4));
      be(b.size(), 1);
    } else {
      out_.push_back(static_cast<char>(0xc5));
      be(b.size(), 2);
    }
    out_.append(b);
  }
  const std::string& bytes() const { return out_; }

 private:
  void container(uint8_t fix, uint8_t tag16, uint32_t n) {  // fixmap/fixarray, else map16/array16
    if (n < 16) {
      out_.push_back(static_cast<char>(fix | n));
    } else {
      out_.push_back(static_cast<char>(tag16));
      be(n, 2);
    }
  }
  void be(uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

// Reads just the msgpack subset a header can contain; anything else is a bad header.
class MsgpackReader {
 public:
  MsgpackReader(const uint8_t* p, size_t n) : p_(p), end_(p + n) {}

  struct Value {
    enum Kind { kUint, kBytes, kOther } kind = kOther;
    uint64_t u = 0;
    std::string_view bytes;
  };

  bool map_header(uint32_t& n) {
    uint8_t b;
    if (!byte(b)) return false;
    if ((b & 0xf0) == 0x80) {
      n = b & 0x0f;
      return true;
    }
    uint64_t v;
    if (b == 0xde && be(2, v)) { n = static_cast<uint32_t>(v); return true; }
    if (b == 0xdf && be(4, v)) { n = static_cast<uint32_t>(v); return true; }
    return false;
  }

  // An array of unsigned ints (version 2's segment checksums).
  bool uint_array(std::vector<uint64_t>& out) {
    uint8_t b;
    if (!byte(b)) return false;
    uint64_t n;
    if ((b & 0xf0) == 0x90) n = b & 0x0f;
    else if (b == 0xdc) { if (!be(2, n)) return false; }
    else return false;
    if (n > kMaxSegments) return false;
    out.clear();
    for (uint64_t i = 0; i < n; ++i) {
      Value v;
      if (!value(v) || v.kind != Value::kUint) return false;
      out.push_back(v.u);
    }
    return true;
  }

  // Reads one value; anything but unsigned ints, str and bin is skipped (kOther), so
  // headers of newer writers with extra fields of any type stay readable.
  bool value(Value& out, int depth = 0) {
    uint8_t b;
    if (!byte(b) || depth > 8) return false;
    uint64_t v = 0;
    out.kind = Value::kOther;
    if (b < 0x80) { out.kind = Value::kUint; out.u = b; return true; }
    if (b >= 0xe0) return true;                          // negative fixint
    if ((b & 0xf0) == 0x80) return skip(2 * (b & 0x0f), depth);  // fixmap
    if ((b & 0xf0) == 0x90) return skip(b & 0x0f, depth);        // fixarray
    if ((b & 0xe0) == 0xa0) return raw(b & 0x1f, out);           // fixstr
    switch (b) {
      case 0xc0: case 0xc2: case 0xc3: return true;      // nil, false, true
      case 0xcc: case 0xcd: case 0xce: case 0xcf:
        if (!be(1 << (b - 0xcc), v)) return false;
        out.kind = Value::kUint;
        out.u = v;
        return true;
      case 0xd0: case 0xd1: case 0xd2: case 0xd3: return advance(1u << (b - 0xd0));  // int8..64
      case 0xca: return advance(4);                      // float32
      case 0xcb: return advance(8);                      // float64
      case 0xc4: case 0xd9: return be(1, v) && raw(v, out);
      case 0xc5: case 0xda: return be(2, v) && raw(v, out);
      case 0xc6: case 0xdb: return be(4, v) && raw(v, out);
      case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8: return advance(1 + (1u << (b - 0xd4)));  // fixext
      case 0xc7: return be(1, v) && advance(1 + v);      // ext8/16/32
      case 0xc8: return be(2, v) && advance(1 + v);
      case 0xc9: return be(4, v) && advance(1 + v);
      case 0xdc: return be(2, v) && skip(v, depth);      // array16/32
      case 0xdd: return be(4, v) && skip(v, depth);
      case 0xde: return be(2, v) && skip(2 * v, depth);  // map16/32
      case 0xdf: return be(4, v) && skip(2 * v, depth);
      default: return false;                             // 0xc1 is never used
    }
  }

 private:
  bool byte(uint8_t& b) {
    if (p_ >= end_) return false;
    b = *p_++;
    return true;
  }
  bool be(int n, uint64_t& v) {
    if (end_ - p_ < n) return false;
    v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | p_[i];
    p_ += n;
    return true;
  }
  bool advance(uint64_t n) {
    if (static_cast<uint64_t>(end_ - p_) < n) return false;
    p_ += n;
    return true;
  }
  bool skip(uint64_t values, int depth) {
    Value ignored;
    for (uint64_t i = 0; i < values; ++i)
      if (!value(ignored, depth + 1)) return false;
    return true;
  }
  bool raw(uint64_t n, Value& out) {
    if (static_cast<uint64_t>(end_ - p_) < n) return false;
    out.kind = Value::kBytes;
    out.bytes = std::string_view(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return true;
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

uint64_t header_digest(const BlockHeader& h) {
  uint8_t fields[40];
  const uint64_t values[5] = {h.version, h.payload_offset, h.payload_len, h.token_count, h.checksum};
  for (int f = 0; f < 5; ++f)
    for (int i = 0; i < 8; ++i) fields[8 * f + i] = static_cast<uint8_t>((values[f] >> (8 * i)) & 0xff);
  Xxh64 hash(0);
  hash.update(fields, sizeof(fields));
  hash.update(h.key.data(), h.key.size());
  return hash.digest();
}

// Fills the 4096-byte header region (prefix + msgpack + zero padding).
void encode_header_region(const BlockHeader& h, uint8_t* region) {
  MsgpackWriter w;
  const bool segmented = !h.segments.empty();
  w.map_header(segmented ? 8 : 7);
  w.str("version");        w.uint(h.version);
  w.str("payload_offset"); w.uint(h.payload_offset);
  w.str("payload_len");    w.uint(h.payload_len);
  w.str("token_count");    w.uint(h.token_count);
  w.str("xxh64");          w.uint(h.checksum);
  w.str("key");            w.bin(h.key);
  w.str("header_xxh64");   w.uint(h.header_checksum);
  if (segmented) {
    w.str("segments");
    w.array_header(static_cast<uint32_t>(h.segments.size()));
    for (uint64_t d : h.segments) w.uint(d);
  }
  const std::string& mp = w.bytes();
  std::memset(region, 0, kHeaderRegion);
  std::memcpy(region, kMagic, sizeof(kMagic));
  uint32_t n = static_cast<uint32_t>(mp.size());
  for (int i = 0; i < 4; ++i) region[8 + i] = static_cast<uint8_t>((n >> (8 * i)) & 0xff);
  std::memcpy(region + kPrefixSize, mp.data(), mp.size());
}

int decode_header_region(const uint8_t* region, BlockHeader& h) {
  if (std::memcmp(region, kMagic, sizeof(kMagic)) != 0) return kBadHeader;
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(region[8 + i]) << (8 * i);
  if (n > kHeaderRegion - kPrefixSize) return kBadHeader;
  MsgpackReader r(region + kPrefixSize, n);
  uint32_t entries = 0;
  if (!r.map_header(entries)) return kBadHeader;
  unsigned seen = 0;
  for (uint32_t i = 0; i < entries; ++i) {
    MsgpackReader::Value k, v;
    if (!r.value(k)) return kBadHeader;
    if (k.kind == MsgpackReader::Value::kBytes && k.bytes == "segments") {
      if (!r.uint_array(h.segments) || h.segments.empty()) return kBadHeader;
      seen |= 128;
      continue;
    }
    if (!r.value(v)) return kBadHeader;
    if (k.kind != MsgpackReader::Value::kBytes) continue;
    auto take_uint = [&](uint64_t& dst, unsigned bit) {
      if (v.kind != MsgpackReader::Value::kUint) return false;
      dst = v.u;
      seen |= bit;
      return true;
    };
    bool ok = true;
    if (k.bytes == "version") ok = take_uint(h.version, 1);
    else if (k.bytes == "payload_offset") ok = take_uint(h.payload_offset, 2);
    else if (k.bytes == "payload_len") ok = take_uint(h.payload_len, 4);
    else if (k.bytes == "token_count") ok = take_uint(h.token_count, 8);
    else if (k.bytes == "xxh64") ok = take_uint(h.checksum, 16);
    else if (k.bytes == "key") {
      ok = v.kind == MsgpackReader::Value::kBytes;
      h.key.assign(v.bytes);
      seen |= 32;
    } else if (k.bytes == "header_xxh64") ok = take_uint(h.header_checksum, 64);
    if (!ok) return kBadHeader;
  }
  if ((seen & 1) && h.version != kFormatVersion && h.version != kSegmentedVersion) return kUnsupportedVersion;
  const unsigned want = h.version == kSegmentedVersion ? 255 : 127;
  if (seen != want || h.payload_offset != kHeaderRegion) return kBadHeader;
  if (header_digest(h) != h.header_checksum) return kBadHeader;
  if (h.version == kSegmentedVersion &&
      (h.payload_len % h.segments.size() != 0 || segments_digest(h.segments) != h.checksum))
    return kBadHeader;
  return kOk;
}

// ---------------------------------------------------------------------------
// POSIX helpers
// ---------------------------------------------------------------------------
std::atomic<uint64_t> g_direct_fallbacks{0};

// Some filesystems accept O_DIRECT at open but reject the IO; switch the fd
// to buffered IO and let the caller retry.
bool drop_direct_on_einval(int fd) {
  if (errno != EINVAL) return false;
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || !(fl & O_DIRECT)) return false;
  if (fcntl(fd, F_SETFL, fl & ~O_DIRECT) != 0) return false;
  g_direct_fallbacks.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// preadv() or pwritev() until every iovec is moved, retrying EINTR and short calls: bytes moved
// (short only at a read's EOF) or -1 with errno set (EIO for a write that moves nothing).
ssize_t vectored_full(bool write, int fd, struct iovec* iov, int cnt, off_t off) {
  size_t done = 0;
  while (cnt > 0) {
    off_t at = off + static_cast<off_t>(done);
    ssize_t r = write ? ::pwritev(fd, iov, cnt, at) : ::preadv(fd, iov, cnt, at);
    if (r < 0) {
      if (errno == EINTR || drop_direct_on_einval(fd)) continue;
      return -1;
    }
    if (r == 0) {
      if (!write) break;
      errno = EIO;
      return -1;
    }
    done += static_cast<size_t>(r);
    for (size_t left = static_cast<size_t>(r); cnt > 0 && left > 0; ) {  // drop what moved
      size_t n = std::min(left, iov->iov_len);
      iov->iov_base = static_cast<char*>(iov->iov_base) + n;
      iov->iov_len -= n;
      left -= n;
      if (iov->iov_len == 0) {
        ++iov;
        --cnt;
      }
    }
  }
  return static_cast<ssize_t>(done);
}

bool is_direct(int fd) {
  int fl = fcntl(fd, F_GETFL);
  return fl >= 0 && (fl & O_DIRECT);
}

// open() that falls back to buffered IO where O_DIRECT is refused (tmpfs: EINVAL).
// Explicit modes: a umask of 000 must not make blocks or shards world-writable.
constexpr mode_t kFileMode = 0644;
constexpr mode_t kDirMode = 0755;

// openat() that falls back to buffered IO where O_DIRECT is refused (tmpfs: EINVAL). Never
// follows a symlink at the block's own name (O_NOFOLLOW), never blocks on a FIFO there (O_NONBLOCK).
int open_maybe_direct(int dir, const std::string& name, int flags, bool direct) {
  flags |= O_NOFOLLOW | O_NONBLOCK;
  if (direct) {
    int fd = ::openat(dir, name.c_str(), flags | O_DIRECT, kFileMode);
    if (fd >= 0 || errno != EINVAL) return fd;
    g_direct_fallbacks.fetch_add(1, std::memory_order_relaxed);
  }
  return ::openat(dir, name.c_str(), flags, kFileMode);
}

// The directory a block or temp file lives in, `<root>/<s1>/<s2>/`, opened without following a
// symlink at either shard (a symlinked shard would put blocks outside the store: never counted,
// never evicted). The root is the operator's path and may be a symlink. `create` makes missing
// shards. Owns its fd; valid() false with errno set (ELOOP or ENOTDIR: a shard is not a directory).
class ShardDir {
 public:
  ShardDir(const std::string& path, bool create) {
    size_t p3 = path.rfind('/');
    size_t p2 = p3 == std::string::npos || p3 == 0 ? std::string::npos : path.rfind('/', p3 - 1);
    size_t p1 = p2 == std::string::npos || p2 == 0 ? std::string::npos : path.rfind('/', p2 - 1);
    if (p1 == std::string::npos) {
      errno = EINVAL;
      return;
    }
    name_ = path.substr(p3 + 1);
    int root = ::open(path.substr(0, p1).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (root < 0) return;
    int s1 = open_shard(root, path.substr(p1 + 1, p2 - p1 - 1), create);
    int saved = errno;
    ::close(root);
    if (s1 < 0) {
      errno = saved;
      return;
    }
    fd_ = open_shard(s1, path.substr(p2 + 1, p3 - p2 - 1), create);
    saved = errno;
    ::close(s1);
    errno = saved;
  }
  ~ShardDir() {
    if (fd_ >= 0) ::close(fd_);
  }
  ShardDir(const ShardDir&) = delete;
  ShardDir& operator=(const ShardDir&) = delete;
  bool valid() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  const std::string& name() const { return name_; }

 private:
  static int open_shard(int parent, const std::string& name, bool create) {
    const int flags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
    int fd = ::openat(parent, name.c_str(), flags);
    if (fd >= 0 || errno != ENOENT || !create) return fd;
    if (::mkdirat(parent, name.c_str(), kDirMode) != 0 && errno != EEXIST) return -1;
    return ::openat(parent, name.c_str(), flags);
  }
  int fd_ = -1;
  std::string name_;
};

std::string base_name(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuf = std::unique_ptr<uint8_t, FreeDeleter>;

AlignedBuf aligned_alloc_or_throw(size_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, kAlign, n) != 0) throw std::bad_alloc();
  return AlignedBuf(static_cast<uint8_t*>(p));
}

// Per worker thread: one header region and one chunk, both aligned for O_DIRECT, and a bounce
// buffer for O_DIRECT calls on unaligned memory, grown on first use up to kIoUnit.
struct ScratchBuffers {
  AlignedBuf region = aligned_alloc_or_throw(kHeaderRegion);
  AlignedBuf chunk = aligned_alloc_or_throw(kChunk);
  AlignedBuf bounce;
  size_t bounce_size = 0;
  uint8_t* bounce_of(size_t n) {
    if (n > bounce_size) {
      bounce = aligned_alloc_or_throw(n);
      bounce_size = n;
    }
    return bounce.get();
  }
};
ScratchBuffers& scratch() {
  thread_local ScratchBuffers s;
  return s;
}

inline size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
inline bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kAlign == 0; }

// ---------------------------------------------------------------------------
// Per-block operations (run on worker threads; no Python objects touched)
// ---------------------------------------------------------------------------
struct Item {
  std::string path;      // final block path (read: the file to read)
  std::string tmp_path;  // write only
  std::string key;
  uint8_t* data = nullptr;
  size_t size = 0;
  uint64_t token_count = 0;
  uint32_t segments = 1;  // write: equal segments, each with its own checksum (> 1: version 2)
  // A segment read: segments [seg_first, seg_first + parts.size()) of a block of seg_total, each
  // into its own destination (0 seg_total: the whole payload into data, size).
  std::vector<std::pair<uint8_t*, size_t>> parts;
  uint32_t seg_first = 0;
  uint32_t seg_total = 0;
  int status = kIoError;
  int err = 0;
};

// Whether `data` (the payload) matches the header's checksum, or each of its segment checksums.
bool payload_matches(const BlockHeader& h, const uint8_t* data) {
  if (h.segments.empty()) return xxh64_of(data, h.payload_len) == h.checksum;
  return segment_digests(data, h.payload_len, h.segments.size()) == h.segments;
}

struct IoOptions {
  bool direct = false;
  bool fsync = false;
  double touch_interval_s = 0.0;  // < 0: never touch mtime on read
};

// Writes the header region and the payload, the header with the payload's first piece: one call
// per kIoUnit bytes. Sets `padded` when O_DIRECT wrote zeros past the payload (the file must be cut).
bool write_region_and_payload(int fd, const Item& it, uint8_t* region, bool& padded) {
  ScratchBuffers& s = scratch();
  bool first = true;
  for (size_t off = 0; first || off < it.size; first = false) {
    size_t n = std::min(kIoUnit, it.size - off);
    uint8_t* src = it.data + off;
    struct iovec iov[2];
    int cnt = 0;
    if (first) iov[cnt++] = {region, kHeaderRegion};
    if (n && (!is_direct(fd) || (aligned(src) && n % kAlign == 0))) {
      iov[cnt++] = {src, n};
    } else if (n) {
      size_t rounded = round_up(n, kAlign);
      uint8_t* bounce = s.bounce_of(rounded);
      std::memcpy(bounce, src, n);
      std::memset(bounce + n, 0, rounded - n);
      iov[cnt++] = {bounce, rounded};
      padded = padded || rounded > n;
    }
    off_t at = first ? 0 : static_cast<off_t>(kHeaderRegion + off);
    if (vectored_full(/*write=*/true, fd, iov, cnt, at) < 0) return false;
    off += n;
  }
  return true;
}

void write_block(Item& it, const IoOptions& opt) {
  struct stat st;
  ShardDir dir(it.path, /*create=*/true);
  if (!dir.valid()) {
    it.err = errno;
    it.status = kIoError;
    return;
  }
  // A regular file is a stored block; anything else at its name (a symlink, a FIFO) is replaced
  // by the rename below, never followed or written through.
  if (::fstatat(dir.fd(), dir.name().c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) {
    it.status = kExists;
    return;
  }
  const std::string tmp_name = base_name(it.tmp_path);
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
  int fd = open_maybe_direct(dir.fd(), tmp_name, flags, opt.direct);
  if (fd < 0) {
    it.err = errno;
    it.status = kIoError;
    return;
  }
  // The payload is hashed first: its header, which carries the checksums, goes with its first bytes.
  BlockHeader h;
  if (it.segments > 1) {
    h.segments = segment_digests(it.data, it.size, it.segments);
    h.version = kSegmentedVersion;
    h.checksum = segments_digest(h.segments);
  } else {
    h.version = kFormatVersion;
    h.checksum = xxh64_of(it.data, it.size);
  }
  h.payload_offset = kHeaderRegion;
  h.payload_len = it.size;
  h.token_count = it.token_count;
  h.key = it.key;
  h.header_checksum = header_digest(h);
  uint8_t* region = scratch().region.get();
  encode_header_region(h, region);
  bool padded = false;
  bool ok = write_region_and_payload(fd, it, region, padded);
  // O_DIRECT wrote the last piece padded; cut the file to its exact length.
  if (ok && padded) ok = ::ftruncate(fd, static_cast<off_t>(kHeaderRegion + it.size)) == 0;
  if (ok && opt.fsync) ok = ::fsync(fd) == 0;
  int saved = ok ? 0 : errno;
  // close() reports deferred write errors on NFS, so it counts.
  if (::close(fd) != 0 && ok) {
    ok = false;
    saved = errno;
  }
  if (ok && ::renameat(dir.fd(), tmp_name.c_str(), dir.fd(), dir.name().c_str()) != 0) {
    ok = false;
    saved = errno;
  }
  if (!ok) {
    ::unlinkat(dir.fd(), tmp_name.c_str(), 0);
    it.err = saved;
    it.status = kIoError;
    return;
  }
  it.status = kOk;
}

// Reads the payload, and with its first call the header region (the file's first kHeaderRegion
// bytes) into `region`: one call per kIoUnit bytes. Returns kOk, kTruncated or kIoError.
int read_region_and_payload(int fd, Item& it, uint8_t* region) {
  ScratchBuffers& s = scratch();
  bool first = true;
  for (size_t off = 0; first || off < it.size; first = false) {
    const bool direct = is_direct(fd);
    size_t n = std::min(kIoUnit, it.size - off);
    uint8_t* dst = it.data + off;
    struct iovec iov[3];
    int cnt = 0;
    size_t want = n;
    if (first) {
      iov[cnt++] = {region, kHeaderRegion};
      want += kHeaderRegion;
    }
    uint8_t* copy_from = nullptr;  // where the bytes that must be copied to dst + copied_at landed
    size_t copied_at = 0;
    if (!direct) {
      if (n) iov[cnt++] = {dst, n};
    } else if (aligned(dst)) {  // straight into the destination, an unaligned tail through the chunk
      size_t whole = n / kAlign * kAlign;
      if (whole) iov[cnt++] = {dst, whole};
      if (n > whole) {
        iov[cnt++] = {s.chunk.get(), round_up(n - whole, kAlign)};
        copy_from = s.chunk.get();
        copied_at = whole;
      }
    } else if (n) {
      copy_from = s.bounce_of(round_up(n, kAlign));
      iov[cnt++] = {copy_from, round_up(n, kAlign)};
    }
    off_t at = first ? 0 : static_cast<off_t>(kHeaderRegion + off);
    ssize_t got = vectored_full(/*write=*/false, fd, iov, cnt, at);
    if (got < 0) {
      it.err = errno;
      return kIoError;
    }
    if (static_cast<size_t>(got) < want) return kTruncated;
    if (copy_from) std::memcpy(dst + copied_at, copy_from, n - copied_at);
    off += n;
  }
  return kOk;
}

void maybe_touch(int fd, const struct stat& st, double touch_interval_s) {
  if (touch_interval_s < 0) return;
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  double age = static_cast<double>(now.tv_sec - st.st_mtim.tv_sec) +
               1e-9 * static_cast<double>(now.tv_nsec - st.st_mtim.tv_nsec);
  // Best effort: a read-only mount or a foreign owner only costs LRU precision.
  if (age >= touch_interval_s) (void)::futimens(fd, nullptr);
}

// Reads `iov` from `at` to its end: kOk, kTruncated (the file ended first) or kIoError (errno kept).
int read_fully(int fd, std::vector<struct iovec> iov, off_t at, Item& it) {
  size_t want = 0;
  for (auto& v : iov) want += v.iov_len;
  ssize_t got = vectored_full(/*write=*/false, fd, iov.data(), static_cast<int>(iov.size()), at);
  if (got < 0) {
    it.err = errno;
    return kIoError;
  }
  return static_cast<size_t>(got) < want ? kTruncated : kOk;
}

// fstat of an open block: kOk, kIoError, or kBadHeader for a FIFO, device or directory.
int stat_block(int fd, struct stat& st, Item& it) {
  if (::fstat(fd, &st) != 0) {
    it.err = errno;
    return kIoError;
  }
  return S_ISREG(st.st_mode) ? kOk : kBadHeader;
}

int read_block_fd(int fd, Item& it, const IoOptions& opt) {
  struct stat st;
  if (int rc = stat_block(fd, st, it); rc != kOk) return rc;
  uint8_t* region = scratch().region.get();
  uint64_t expected = kHeaderRegion + it.size;
  if (static_cast<uint64_t>(st.st_size) == expected) {  // the usual case: header and payload together
    int rc = read_region_and_payload(fd, it, region);
    if (rc != kOk) return rc;
  } else if (int rc = read_fully(fd, {{region, kHeaderRegion}}, 0, it); rc != kOk) {
    return rc;  // else the header says what is wrong with the file
  }
  BlockHeader h;
  int rc = decode_header_region(region, h);
  if (rc != kOk) return rc;
  if (h.key != it.key) return kBadHeader;
  if (h.payload_len != it.size) return kLengthMismatch;
  if (static_cast<uint64_t>(st.st_size) < expected) return kTruncated;
  if (static_cast<uint64_t>(st.st_size) > expected) return kBadHeader;
  if (!payload_matches(h, it.data)) return kChecksumMismatch;
  it.token_count = h.token_count;
  maybe_touch(fd, st, opt.touch_interval_s);
  return kOk;
}

// Reads some segments of a version 2 block, each into its part, and verifies only them: the
// header region first, with the segments in the same call when they start the payload.
int read_segments_fd(int fd, Item& it, const IoOptions& opt) {
  struct stat st;
  if (int rc = stat_block(fd, st, it); rc != kOk) return rc;
  const size_t seg = it.parts.front().second;
  const uint64_t expected = kHeaderRegion + static_cast<uint64_t>(seg) * it.seg_total;
  const bool together = it.seg_first == 0 && static_cast<uint64_t>(st.st_size) == expected;
  uint8_t* region = scratch().region.get();
  std::vector<struct iovec> parts;
  for (auto& p : it.parts) parts.push_back({p.first, p.second});
  std::vector<struct iovec> first{{region, kHeaderRegion}};
  if (together) first.insert(first.end(), parts.begin(), parts.end());
  if (int rc = read_fully(fd, first, 0, it); rc != kOk) return rc;
  BlockHeader h;
  int rc = decode_header_region(region, h);
  if (rc != kOk) return rc;
  if (h.key != it.key) return kBadHeader;
  if (h.segments.size() != it.seg_total) return kNotSegmented;  // version 1, or other segments
  if (h.payload_len != expected - kHeaderRegion) return kLengthMismatch;
  if (static_cast<uint64_t>(st.st_size) < expected) return kTruncated;
  if (static_cast<uint64_t>(st.st_size) > expected) return kBadHeader;
  if (!together) {
    off_t at = static_cast<off_t>(kHeaderRegion + static_cast<uint64_t>(seg) * it.seg_first);
    if (rc = read_fully(fd, parts, at, it); rc != kOk) return rc;
  }
  for (size_t j = 0; j < it.parts.size(); ++j)
    if (xxh64_of(it.parts[j].first, it.parts[j].second) != h.segments[it.seg_first + j]) return kChecksumMismatch;
  it.token_count = h.token_count;
  maybe_touch(fd, st, opt.touch_interval_s);
  return kOk;
}

void read_block(Item& it, const IoOptions& opt) {
  ShardDir dir(it.path, /*create=*/false);
  // Segments land in parts of a caller's buffer, seldom aligned: they are read buffered.
  const bool segments = it.seg_total > 0;
  int fd = dir.valid() ? open_maybe_direct(dir.fd(), dir.name(), O_RDONLY | O_CLOEXEC, opt.direct && !segments) : -1;
  if (!dir.valid() && (errno == ELOOP || errno == ENOTDIR)) {
    it.err = errno;
    it.status = kNotFound;  // behind a symlinked shard: not part of the store
    return;
  }
  if (fd < 0) {
    it.err = errno;
    if (errno == ENOENT || errno == ENOTDIR) {
      it.status = kNotFound;
    } else if (errno == ELOOP) {
      it.status = kBadHeader;  // a symlink at the block's name: removed like a corrupt block
    } else {
      it.status = kIoError;
    }
    return;
  }
  // A read that ends at the end of the file is advised sequential: the kernel reads ahead in
  // larger requests (twice its window on Linux), so a network file system answers in fewer round
  // trips. A run of segments that stops short (a layer group) is advised random: reading ahead
  // past it would fetch the next groups' bytes over the link, and a file system that drops a
  // file's cached pages when it is opened again (FUSE by default) fetches them again for them.
  const bool to_end = !segments || it.seg_first + it.parts.size() == it.seg_total;
  if (!is_direct(fd)) (void)::posix_fadvise(fd, 0, 0, to_end ? POSIX_FADV_SEQUENTIAL : POSIX_FADV_RANDOM);
  it.status = segments ? read_segments_fd(fd, it, opt) : read_block_fd(fd, it, opt);
  ::close(fd);
}

// ---------------------------------------------------------------------------
// Python buffers pinned for the lifetime of a task
// ---------------------------------------------------------------------------
class PinnedBuffer {
 public:
  PinnedBuffer(py::handle obj, bool writable) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) throw py::error_already_set();
    held_ = true;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept : view_(o.view_), held_(o.held_) { o.held_ = false; }
  ~PinnedBuffer() {  // callers guarantee the GIL is held
    if (held_) PyBuffer_Release(&view_);
  }
  uint8_t* data() const { return static_cast<uint8_t*>(view_.buf); }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// ---------------------------------------------------------------------------
// Thread pool
// ---------------------------------------------------------------------------
struct Task {
  bool is_write = false;
  std::vector<Item> items;
  std::vector<PinnedBuffer> pins;  // released under the GIL by wait()/close()
  std::atomic<size_t> remaining{0};
  std::atomic<bool> done{false};
  std::mutex m;
  std::condition_variable cv;
  std::chrono::steady_clock::time_point submitted;
  std::chrono::steady_clock::time_point finished;
};

using Job = std::pair<std::shared_ptr<Task>, size_t>;

class IoEngine {
 public:
  // cpus: cores for the IO threads (empty: inherit the creating thread's). A creator bound to one
  // core by vLLM's CPU worker would otherwise leave every read to that core while the rest idle.
  IoEngine(int num_threads, bool direct, bool fsync, double touch_interval_s, std::vector<int> cpus) {
    if (num_threads < 1 || num_threads > 256) throw py::value_error("num_threads must be in 1..256");
    for (int c : cpus)
      if (c < 0 || c >= CPU_SETSIZE) throw py::value_error("cpus: core " + std::to_string(c) + " out of range");
    opt_.direct = direct;
    opt_.fsync = fsync;
    opt_.touch_interval_s = touch_interval_s;
    for (int i = 0; i < num_threads; ++i)
      workers_.emplace_back([this, cpus] {
        if (!cpus.empty()) {
          cpu_set_t set;
          CPU_ZERO(&set);
          for (int c : cpus) CPU_SET(c, &set);
          pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: inherited if refused
        }
        pthread_setname_np(pthread_self(), "ucm-store-io");
        {
          std::lock_guard<std::mutex> lk(queue_mu_);
          ++started_;
        }
        queue_cv_.notify_all();
        worker_loop();
      });
    // Ready means placed and named: callers (and /proc) see the threads as configured.
    std::unique_lock<std::mutex> lk(queue_mu_);
    queue_cv_.wait(lk, [&] { return started_ == num_threads; });
  }

  ~IoEngine() { shutdown(/*release_gil=*/false); }

  int64_t submit_write(const std::vector<std::string>& keys, const std::vector<std::string>& tmp_paths,
                       const std::vector<std::string>& final_paths, const py::sequence& buffers,
                       const std::vector<uint64_t>& token_counts, const std::vector<uint32_t>& segments) {
    size_t n = keys.size();
    if (tmp_paths.size() != n || final_paths.size() != n || static_cast<size_t>(py::len(buffers)) != n ||
        token_counts.size() != n || (!segments.empty() && segments.size() != n))
      throw py::value_error("submit_write: keys, tmp_paths, final_paths, buffers, token_counts, segments differ "
                            "in length");
    auto task = std::make_shared<Task>();
    task->is_write = true;
    task->items.resize(n);
    task->pins.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      task->pins.push_back(pin(buffers[i], /*writable=*/false, "source", i));
      Item& it = task->items[i];
      it.key = keys[i];
      it.tmp_path = tmp_paths[i];
      it.path = final_paths[i];
      it.data = task->pins.back().data();
      it.size = task->pins.back().size();
      it.token_count = token_counts[i];
      if (!segments.empty()) {
        it.segments = segments[i];
        if (it.segments < 1 || it.segments > kMaxSegments || it.size % it.segments != 0)
          throw py::value_error("submit_write: source " + std::to_string(i) + " of " + std::to_string(it.size) +
                                " bytes cannot be " + std::to_string(it.segments) + " equal segments (1.." +
                                std::to_string(kMaxSegments) + ")");
      }
    }
    return enqueue(std::move(task));
  }

  // Reads segments [first, first + len(buffers[i])) of each block of `total` equal segments, the
  // j-th into buffers[i][j] (all of one segment's size), verifying only those segments.
  int64_t submit_read_segments(const std::vector<std::string>& keys, const std::vector<std::string>& paths,
                               const py::sequence& buffers, uint32_t first, uint32_t total) {
    size_t n = keys.size();
    if (paths.size() != n || static_cast<size_t>(py::len(buffers)) != n)
      throw py::value_error("submit_read_segments: keys, paths, buffers differ in length");
    if (total < 1 || total > kMaxSegments)
      throw py::value_error("submit_read_segments: total must be in 1.." + std::to_string(kMaxSegments));
    auto task = std::make_shared<Task>();
    task->items.resize(n);
    for (size_t i = 0; i < n; ++i) {
      py::sequence parts = py::reinterpret_borrow<py::sequence>(buffers[i]);
      size_t m = static_cast<size_t>(py::len(parts));
      if (m < 1 || first + m > total)
        throw py::value_error("submit_read_segments: block " + std::to_string(i) + " asks for segments " +
                              std::to_string(first) + ".." + std::to_string(first + m) + " of " +
                              std::to_string(total));
      Item& it = task->items[i];
      it.key = keys[i];
      it.path = paths[i];
      it.seg_first = first;
      it.seg_total = total;
      for (size_t j = 0; j < m; ++j) {
        task->pins.push_back(pin(parts[j], /*writable=*/true, "destination", i));
        it.parts.emplace_back(task->pins.back().data(), task->pins.back().size());
        if (it.parts.back().second != it.parts.front().second || it.parts.back().second == 0)
          throw py::value_error("submit_read_segments: block " + std::to_string(i) +
                                "'s destinations are not of one non-zero size");
      }
      it.data = it.parts.front().first;
      it.size = it.parts.front().second * m;
    }
    return enqueue(std::move(task));
  }

  int64_t submit_read(const std::vector<std::string>& keys, const std::vector<std::string>& paths,
                      const py::sequence& buffers) {
    size_t n = keys.size();
    if (paths.size() != n || static_cast<size_t>(py::len(buffers)) != n)
      throw py::value_error("submit_read: keys, paths, buffers differ in length");
    auto task = std::make_shared<Task>();
    task->items.resize(n);
    task->pins.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      task->pins.push_back(pin(buffers[i], /*writable=*/true, "destination", i));
      Item& it = task->items[i];
      it.key = keys[i];
      it.path = paths[i];
      it.data = task->pins.back().data();
      it.size = task->pins.back().size();
    }
    return enqueue(std::move(task));
  }

  bool poll(int64_t id) { return find(id)->done.load(std::memory_order_acquire); }

  // -> (statuses, errnos, token_counts, seconds from submit to completion), or None when
  // `timeout_s` (>= 0) passed first: the task then stays pending, its buffers pinned (an IO thread
  // may still write them), and can be waited for again.
  py::object wait(int64_t id, double timeout_s) {
    std::shared_ptr<Task> task = find(id);
    bool done = true;
    {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lk(task->m);
      auto ready = [&] { return task->done.load(std::memory_order_acquire); };
      if (timeout_s < 0)
        task->cv.wait(lk, ready);
      else
        done = task->cv.wait_for(lk, std::chrono::duration<double>(timeout_s), ready);
    }
    if (!done) return py::none();
    {
      std::lock_guard<std::mutex> lk(tasks_mu_);
      tasks_.erase(id);
    }
    task->pins.clear();  // GIL held here
    std::vector<int> statuses, errnos;
    std::vector<uint64_t> tokens;
    for (const Item& it : task->items) {
      statuses.push_back(it.status);
      errnos.push_back(it.err);
      tokens.push_back(it.token_count);
    }
    double secs = std::chrono::duration<double>(task->finished - task->submitted).count();
    return py::make_tuple(statuses, errnos, tokens, secs);
  }

  // Existence of many files, in the calling thread(s) so lookups never queue behind bulk IO.
  std::vector<bool> exists(const std::vector<std::string>& paths) {
    std::vector<char> found(paths.size(), 0);
    {
      py::gil_scoped_release nogil;
      auto run = [&](size_t begin, size_t end) {
        struct stat st;
        // A regular file in real shard directories: what a load can read and a dump would skip.
        for (size_t i = begin; i < end; ++i) {
          ShardDir dir(paths[i], /*create=*/false);
          found[i] = dir.valid() && ::fstatat(dir.fd(), dir.name().c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                     S_ISREG(st.st_mode);
        }
      };
      // The cost of one stat, as the calling thread measured it on its own paths in the last call
      // (thread starts left out), sizes this call's threads.
      auto timed = [&](size_t begin, size_t end) {
        auto start = std::chrono::steady_clock::now();
        run(begin, end);
        int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
                         .count();
        stat_ns_.store(ns / static_cast<int64_t>(std::max<size_t>(1, end - begin)));
      };
      if (paths.empty()) return {};
      size_t per = stats_per_thread(stat_ns_.load());
      size_t parts = std::min(kStatThreads, (paths.size() + per - 1) / per);
      if (parts <= 1) {
        timed(0, paths.size());
      } else {
        std::vector<std::thread> helpers;
        size_t chunk = (paths.size() + parts - 1) / parts;
        size_t begin = chunk;  // the first path no helper took
        try {
          for (; begin < paths.size(); begin += chunk)
            helpers.emplace_back(run, begin, std::min(paths.size(), begin + chunk));
        } catch (const std::system_error&) {  // no thread to be had: the caller stats the rest itself
        }
        timed(0, std::min(paths.size(), chunk));
        if (begin < paths.size()) run(begin, paths.size());
        for (auto& t : helpers) t.join();
      }
    }
    return std::vector<bool>(found.begin(), found.end());
  }

  // Paths per stat thread for stats of `ns` each (0: not measured yet; exposed for tests).
  static size_t stats_per_thread(int64_t ns) {
    if (ns <= 0) return kStatsPerThreadUnmeasured;
    return static_cast<size_t>(std::max<int64_t>(1, kStatThreadWorkNs / ns));
  }

  void close() { shutdown(/*release_gil=*/true); }

  int num_threads() const { return static_cast<int>(workers_.size()); }
  bool direct_io() const { return opt_.direct; }

 private:
  int started_ = 0;  // workers past their set-up (guarded by queue_mu_)
  std::atomic<int64_t> stat_ns_{0};  // a stat's cost in the last lookup (ns; 0 before the first)
  PinnedBuffer pin(py::handle obj, bool writable, const char* what, size_t i) {
    try {
      return PinnedBuffer(obj, writable);
    } catch (py::error_already_set& e) {
      throw py::value_error(std::string(what) + " " + std::to_string(i) + " is not a " +
                            (writable ? "writable " : "") + "C-contiguous buffer: " + e.what());
    }
  }

  std::shared_ptr<Task> find(int64_t id) {
    std::lock_guard<std::mutex> lk(tasks_mu_);
    auto it = tasks_.find(id);
    if (it == tasks_.end()) throw py::key_error("unknown or already waited task id " + std::to_string(id));
    return it->second;
  }

  int64_t enqueue(std::shared_ptr<Task> task) {
    task->submitted = std::chrono::steady_clock::now();
    task->remaining.store(task->items.size());
    int64_t id;
    {
      std::lock_guard<std::mutex> lk(tasks_mu_);
      if (stopping_) throw std::runtime_error("IoEngine is closed");
      id = next_id_++;
      tasks_[id] = task;
    }
    if (task->items.empty()) {
      task->finished = task->submitted;
      task->done.store(true, std::memory_order_release);
      return id;
    }
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      auto& q = task->is_write ? writes_ : reads_;
      for (size_t i = 0; i < task->items.size(); ++i) q.emplace_back(task, i);
    }
    queue_cv_.notify_all();
    return id;
  }

  // Loads are on the critical path of a request, dumps are background work: reads go first.
  void worker_loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lk(queue_mu_);
        queue_cv_.wait(lk, [&] { return stop_workers_ || !reads_.empty() || !writes_.empty(); });
        auto& q = !reads_.empty() ? reads_ : writes_;
        if (q.empty()) return;  // stopping and drained
        job = std::move(q.front());
        q.pop_front();
      }
      Task& task = *job.first;
      Item& it = task.items[job.second];
      try {
        if (task.is_write) write_block(it, opt_);
        else read_block(it, opt_);
      } catch (const std::exception&) {  // only std::bad_alloc is possible
        it.status = kIoError;
        it.err = ENOMEM;
      }
      if (task.remaining.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lk(task.m);
        task.finished = std::chrono::steady_clock::now();
        task.done.store(true, std::memory_order_release);
        task.cv.notify_all();
      }
    }
  }

  // Finishes queued work (dumps in flight still land), then joins the workers.
  void shutdown(bool release_gil) {
    {
      std::lock_guard<std::mutex> lk(tasks_mu_);
      stopping_ = true;
    }
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      stop_workers_ = true;
    }
    queue_cv_.notify_all();
    {
      std::unique_ptr<py::gil_scoped_release> nogil;
      if (release_gil) nogil = std::make_unique<py::gil_scoped_release>();
      for (auto& t : workers_)
        if (t.joinable()) t.join();
    }
    std::lock_guard<std::mutex> lk(tasks_mu_);
    for (auto& kv : tasks_) kv.second->pins.clear();
  }

  IoOptions opt_;
  std::vector<std::thread> workers_;
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Job> reads_;
  std::deque<Job> writes_;
  bool stop_workers_ = false;
  std::mutex tasks_mu_;
  std::unordered_map<int64_t, std::shared_ptr<Task>> tasks_;
  int64_t next_id_ = 1;
  bool stopping_ = false;
};

uint64_t xxh64_py(py::handle data, uint64_t seed) {
  PinnedBuffer buf(data, /*writable=*/false);
  py::gil_scoped_release nogil;
  Xxh64 h(seed);
  h.update(buf.data(), buf.size());
  return h.digest();
}

}  // namespace ucm

PYBIND11_MODULE(_native, m) {
  using namespace ucm;
  m.doc() = "Native data path of the ucm KV block store: block files, XXH64, threaded IO.";
  m.attr("MAGIC") = py::bytes(kMagic, sizeof(kMagic));
  m.attr("PREFIX_SIZE") = kPrefixSize;
  m.attr("HEADER_REGION") = kHeaderRegion;
  m.attr("FORMAT_VERSION") = kFormatVersion;
  m.attr("SEGMENTED_VERSION") = kSegmentedVersion;
  m.attr("MAX_SEGMENTS") = kMaxSegments;
  py::dict codes;
  codes["OK"] = static_cast<int>(kOk);
  codes["NOT_FOUND"] = static_cast<int>(kNotFound);
  codes["BAD_HEADER"] = static_cast<int>(kBadHeader);
  codes["LENGTH_MISMATCH"] = static_cast<int>(kLengthMismatch);
  codes["CHECKSUM_MISMATCH"] = static_cast<int>(kChecksumMismatch);
  codes["IO_ERROR"] = static_cast<int>(kIoError);
  codes["TRUNCATED"] = static_cast<int>(kTruncated);
  codes["EXISTS"] = static_cast<int>(kExists);
  codes["UNSUPPORTED_VERSION"] = static_cast<int>(kUnsupportedVersion);
  codes["NOT_SEGMENTED"] = static_cast<int>(kNotSegmented);
  m.attr("STATUS_CODES") = codes;

  m.def("xxh64", &xxh64_py, py::arg("data"), py::arg("seed") = 0,
        "XXH64 of a C-contiguous buffer; equals xxhash.xxh64(data, seed).intdigest().");
  m.def("direct_io_fallbacks", [] { return g_direct_fallbacks.load(); },
        "How many times O_DIRECT was refused and buffered IO used instead (process-wide).");

  py::class_<IoEngine>(m, "IoEngine")
      .def(py::init<int, bool, bool, double, std::vector<int>>(), py::arg("num_threads"),
           py::arg("direct_io") = false, py::arg("fsync") = false, py::arg("touch_interval_s") = 60.0,
           py::arg("cpus") = std::vector<int>{})
      .def("submit_write", &IoEngine::submit_write, py::arg("keys"), py::arg("tmp_paths"),
           py::arg("final_paths"), py::arg("buffers"), py::arg("token_counts"),
           py::arg("segments") = std::vector<uint32_t>{})
      .def("submit_read_segments", &IoEngine::submit_read_segments, py::arg("keys"), py::arg("paths"),
           py::arg("buffers"), py::arg("first"), py::arg("total"))
      .def("submit_read", &IoEngine::submit_read, py::arg("keys"), py::arg("paths"), py::arg("buffers"))
      .def("poll", &IoEngine::poll, py::arg("task_id"))
      .def("wait", &IoEngine::wait, py::arg("task_id"), py::arg("timeout_s") = -1.0)
      .def("exists", &IoEngine::exists, py::arg("paths"))
      .def_static("stats_per_thread", &IoEngine::stats_per_thread, py::arg("stat_ns"))
      .def("close", &IoEngine::close)
      .def_property_readonly("num_threads", &IoEngine::num_threads)
      .def_property_readonly("direct_io", &IoEngine::direct_io);
}
