// XreduceLaneCall: a prepared batch's call (xreduce._prepared) made by a TF kernel, with no Python in the step.
//
// xreduce.tensorflow._kernel builds this file into a TF op library on first use (the C++ compiler and TF's own
// headers and flags, tf.sysconfig) and prepares everything in Python once: the segments, registered with the
// daemon; the request frame that names them; where each input goes and each result comes from. Each call then
// copies the inputs into the staging segment, sends the same frame over a local-lane connection of its own, reads
// the reply and hands TF the results where the daemon wrote them: each output is a tensor over its place in the
// kernel's mapping of the output segment (no copy; the output segment is the staging segment itself when the
// results lie over the first replica's inputs, xreduce._prepared's in-place layout); outputs of the previous call
// TF still holds then keep their bytes in memory of their own (Detach), and the segment is mapped anew for the
// call. The daemon serves the same bytes as a kept repeat (xreduced.repeated). A large call of one pair goes in
// phases (xreduce._prepared._phased): a phase's inputs are copied, its request sent, and the next phase's copied
// while the daemon reduces it; the replies are read at the end (the lane serves a connection's calls in order).
// The frames are xreduce.wire.lane's: a 4-byte little-endian length, then the body; a hello first; a reply's body
// is its status code (gRPC's numbers, which TF's are), whether the daemon answered, then the response or the
// error message.
//
// In a multi-process group (one daemon), each call (each phase) is the group's next collective: the kernel appends
// the group's CollectiveSpec (serialized once in Python, without a sequence number) to the request as its field 7
// (a field appended to a serialized protobuf message sets it), with the next number of the process's sequence
// counter, an int64 that Python's collectives take numbers from too (xreduce_next_sequence). The daemon holds
// each process's share of such a repeat until all have come (xreduced.express), then reduces them together.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"

namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::PartialTensorShape;
using tensorflow::Tensor;
using tensorflow::TensorBuffer;
using tensorflow::TensorShape;

constexpr uint32_t kMaxFrameBytes = 0x7fffffffu;
constexpr size_t kParallelCopyBytes = 1 << 20;  // a call's inputs or outputs copied on several threads from here
constexpr size_t kCopyBlockBytes = 256 << 10;
constexpr uintptr_t kAlignBytes = 64;  // TF's CPU tensors' alignment (EIGEN_MAX_ALIGN_BYTES); an output off it is copied

std::atomic<int64_t> calls{0};  // calls answered with results, by every kernel of this process
std::atomic<int64_t> detaches{0};  // calls that first moved results TF still held to memory of their own (Detach)
// Their nanoseconds copying in, exchanging with the daemon, copying out (a call's parts, summed over those calls).
std::atomic<int64_t> copy_in_ns{0}, exchange_ns{0}, copy_out_ns{0};

int64_t NowNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

REGISTER_OP("XreduceLaneCall")
    .Input("inputs: T")
    .Output("outputs: U")
    .Attr("T: list(type)")
    .Attr("U: list(type)")
    .Attr("output_shapes: list(shape)")
    .Attr("address: string")  // the lane: unix:PATH or unix-abstract:NAME
    .Attr("daemon: string")   // the daemon's address, for messages
    .Attr("hello: string")    // the hello frame, its length in front
    .Attr("request: string")  // the request frame, its length in front
    .Attr("staging: string")  // segment names in /dev/shm, and their sizes
    .Attr("staging_bytes: int")
    .Attr("output: string")
    .Attr("output_bytes: int")
    .Attr("input_offsets: list(int)")
    .Attr("output_offsets: list(int)")
    .Attr("timeout: float")  // seconds a call may take
    .Attr("phases: list(string) = []")  // a phased call: every phase's request frame, in order (the first is
                                        // ``request``)...
    .Attr("phase_ranges: list(int) = []")  // ... and the staging bytes it reduces: (phase, begin, end) triples
    .Attr("collective: string = ''")  // in a group: its CollectiveSpec without a sequence number
    .Attr("sequence: int = 0")         // in a group: the address of the process's sequence counter (an int64)
    .SetIsStateful()
    .SetIsDistributedCommunication()  // TF keeps its UNAVAILABLE and ABORTED (it makes them INTERNAL otherwise)
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      std::vector<PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(c->GetAttr("output_shapes", &shapes));
      for (size_t i = 0; i < shapes.size(); ++i) {
        tensorflow::shape_inference::ShapeHandle shape;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &shape));
        c->set_output(static_cast<int>(i), shape);
      }
      return absl::OkStatus();
    });

// A segment of /dev/shm mapped into this process (the kernel's own mapping: it stays valid when Python unlinks
// the segment).
struct Mapping {
  char* data = nullptr;
  size_t size = 0;

  absl::Status Open(const std::string& name, size_t bytes) {
    std::string path = "/dev/shm/" + name;
    int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return absl::FailedPreconditionError("xreduce: cannot open the segment " + path + ": " + strerror(errno));
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    close(fd);
    if (p == MAP_FAILED) return absl::FailedPreconditionError("xreduce: cannot map the segment " + path + ": " + strerror(err));
    data = static_cast<char*>(p);
    size = bytes;
    return absl::OkStatus();
  }

  void Close() {
    if (data != nullptr) munmap(data, size);
    data = nullptr;
  }
};

// The kernel's mapping of the output segment, shared with the tensors over it: unmapped when the last one goes.
struct Shared : Mapping {
  ~Shared() { Close(); }
};

// A result as TF holds it: a tensor buffer over its place in the output segment (it owns no memory of its own).
class Place : public TensorBuffer {
 public:
  Place(std::shared_ptr<Shared> segment, char* data, size_t size)
      : TensorBuffer(data), segment_(std::move(segment)), size_(size) {}
  size_t size() const override { return size_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(tensorflow::AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<int64_t>(size_));
    proto->set_allocated_bytes(static_cast<int64_t>(size_));
    proto->set_allocator_name("xreduce_output_segment");
  }
  bool OwnsMemory() const override { return false; }

 private:
  std::shared_ptr<Shared> segment_;
  size_t size_;
};

class LaneCallOp : public OpKernel {
 public:
  explicit LaneCallOp(OpKernelConstruction* c) : OpKernel(c) {
    int64_t staging_bytes = 0, output_bytes = 0;
    OP_REQUIRES_OK(c, c->GetAttr("output_shapes", &shapes_));
    OP_REQUIRES_OK(c, c->GetAttr("address", &address_));
    OP_REQUIRES_OK(c, c->GetAttr("daemon", &daemon_));
    OP_REQUIRES_OK(c, c->GetAttr("hello", &hello_));
    OP_REQUIRES_OK(c, c->GetAttr("request", &request_));
    OP_REQUIRES_OK(c, c->GetAttr("staging", &staging_name_));
    OP_REQUIRES_OK(c, c->GetAttr("staging_bytes", &staging_bytes));
    OP_REQUIRES_OK(c, c->GetAttr("output", &output_name_));
    OP_REQUIRES_OK(c, c->GetAttr("output_bytes", &output_bytes));
    OP_REQUIRES_OK(c, c->GetAttr("input_offsets", &input_offsets_));
    OP_REQUIRES_OK(c, c->GetAttr("output_offsets", &output_offsets_));
    OP_REQUIRES_OK(c, c->GetAttr("timeout", &timeout_));
    OP_REQUIRES_OK(c, c->GetAttr("collective", &collective_));
    std::vector<int64_t> ranges;
    OP_REQUIRES_OK(c, c->GetAttr("phases", &phases_));
    OP_REQUIRES_OK(c, c->GetAttr("phase_ranges", &ranges));
    OP_REQUIRES(c, ranges.size() % 3 == 0, absl::InvalidArgumentError("xreduce: phase_ranges must be triples"));
    if (phases_.empty()) phases_.push_back(request_);
    ranges_.resize(phases_.size());
    for (size_t k = 0; k < ranges.size(); k += 3) {
      OP_REQUIRES(c, ranges[k] >= 0 && static_cast<size_t>(ranges[k]) < phases_.size() && ranges[k + 1] >= 0 &&
                         ranges[k + 1] <= ranges[k + 2],
                  absl::InvalidArgumentError("xreduce: phase_ranges must name a phase and a range of bytes"));
      ranges_[ranges[k]].emplace_back(ranges[k + 1], ranges[k + 2]);
    }
    int64_t sequence = 0;
    OP_REQUIRES_OK(c, c->GetAttr("sequence", &sequence));
    sequence_ = reinterpret_cast<int64_t*>(static_cast<intptr_t>(sequence));
    OP_REQUIRES(c, collective_.empty() == (sequence_ == nullptr) && request_.size() >= 4,
                absl::InvalidArgumentError("xreduce: a group's call needs both its collective and its sequence"));
    staging_bytes_ = static_cast<size_t>(staging_bytes);
    output_bytes_ = static_cast<size_t>(output_bytes);
    OP_REQUIRES(c, input_offsets_.size() == static_cast<size_t>(c->num_inputs()),
                absl::InvalidArgumentError("xreduce: input_offsets must name one offset per input"));
    OP_REQUIRES(c, output_offsets_.size() == static_cast<size_t>(c->num_outputs()) &&
                       shapes_.size() == static_cast<size_t>(c->num_outputs()),
                absl::InvalidArgumentError("xreduce: output_offsets and output_shapes must name one per output"));
  }

  ~LaneCallOp() override {
    Hangup();
    staging_.Close();
    Release();
  }

  void Compute(OpKernelContext* ctx) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!gave_up_.ok()) {
      ctx->SetStatus(gave_up_);
      return;
    }
    if (staging_.data == nullptr) {
      auto output = std::make_shared<Shared>();
      absl::Status s = staging_.Open(staging_name_, staging_bytes_);
      if (s.ok()) s = output->Open(output_name_, output_bytes_);
      if (!s.ok()) {
        staging_.Close();
        ctx->SetStatus(s);
        return;
      }
      Hold(std::move(output));
    }
    const int64_t start = NowNanos();  // a detach counts as copying in
    for (Place* place : places_) {
      if (place != nullptr && !place->RefCountIsOne()) {  // TF still holds an output of the previous call
        OP_REQUIRES_OK(ctx, Detach());
        break;
      }
    }
    std::vector<Piece> pieces;
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      auto bytes = ctx->input(i).tensor_data();
      OP_REQUIRES(ctx, input_offsets_[i] >= 0 && input_offsets_[i] + bytes.size() <= staging_bytes_,
                  absl::InvalidArgumentError("xreduce: input " + std::to_string(i) + " of " +
                                             std::to_string(bytes.size()) + " bytes does not fit the staging segment"));
      pieces.push_back({staging_.data + input_offsets_[i], bytes.data(), bytes.size()});
    }
    // Each phase's inputs are copied, then its request sent: the daemon reduces one phase while the next is
    // copied, on this thread alone (TF's other threads would take the core the daemon's reduction runs on:
    // 1.31-1.44 ms a call of the 1 M MLP against 1.47-1.71 ms with them). The replies come after.
    int64_t copying = 0;
    absl::Status s;
    size_t sent = 0;
    for (; sent < phases_.size() && s.ok(); ++sent) {
      const int64_t at = NowNanos();
      Copy(ctx, phases_.size() == 1 ? pieces : Within(pieces, ranges_[sent]), sent == 0);
      copying += NowNanos() - at;
      s = Request(phases_[sent]);
    }
    const int64_t copied_in = start + copying;
    std::string reply;
    for (size_t k = 0; k < sent && s.ok(); ++k) {  // the first error a reply names is the call's
      std::string got;
      s = Receive(&got);
      if (s.ok() && (reply.empty() || (reply[0] == 0 && got[0] != 0))) reply = std::move(got);
    }
    const int64_t exchanged = NowNanos();
    if (!s.ok()) {
      // No answer: the daemon may still read the staging segment and write the output one, so this kernel
      // gives them up for good (Python's prepared path does the same); a step traced again prepares new ones.
      Hangup();
      gave_up_ = absl::Status(s.code(), std::string(s.message()) +
                                            " (this step's prepared all-reduce gave up its shared memory; later "
                                            "calls of this traced step fail the same way)");
      ctx->SetStatus(s);
      return;
    }
    int code = static_cast<unsigned char>(reply[0]);
    if (code != 0) {
      ctx->SetStatus(absl::Status(static_cast<absl::StatusCode>(code), reply.substr(2)));
      return;
    }
    pieces.clear();
    for (int i = 0; i < ctx->num_outputs(); ++i) {
      TensorShape shape;
      OP_REQUIRES(ctx, shapes_[i].AsTensorShape(&shape),
                  absl::InvalidArgumentError("xreduce: output_shapes must be fully defined"));
      if (places_[i] != nullptr) {
        ctx->set_output(i, Tensor(output_type(i), shape, places_[i]));  // TF takes a reference
        continue;
      }
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, shape, &out));
      auto bytes = out->tensor_data();
      OP_REQUIRES(ctx, output_offsets_[i] >= 0 && output_offsets_[i] + bytes.size() <= output_bytes_,
                  absl::InternalError("xreduce: output " + std::to_string(i) + " lies outside the output segment"));
      pieces.push_back({const_cast<char*>(bytes.data()), output_->data + output_offsets_[i], bytes.size()});
    }
    Copy(ctx, pieces);
    copy_in_ns.fetch_add(copied_in - start, std::memory_order_relaxed);
    exchange_ns.fetch_add(exchanged - copied_in, std::memory_order_relaxed);
    copy_out_ns.fetch_add(NowNanos() - exchanged, std::memory_order_relaxed);
    calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  struct Piece {
    char* to;
    const char* from;
    size_t size;
  };

  // The parts of ``pieces`` whose destinations lie in ``ranges`` (bytes of the staging segment).
  std::vector<Piece> Within(const std::vector<Piece>& pieces, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
    std::vector<Piece> within;
    for (const Piece& p : pieces) {
      const int64_t begin = p.to - staging_.data, end = begin + static_cast<int64_t>(p.size);
      for (const auto& [lo, hi] : ranges) {
        const int64_t from = std::max(begin, lo), to = std::min(end, hi);
        if (from < to) {
          within.push_back({p.to + (from - begin), p.from + (from - begin), static_cast<size_t>(to - from)});
        }
      }
    }
    return within;
  }

  // Copies the pieces: in this thread below kParallelCopyBytes or when not ``parallel``, else in blocks on TF's CPU
  // worker threads too (the step's other threads wait for this call meanwhile; one core's memcpy of a few MiB is
  // memory-bound at about half of what two reach).
  static void Copy(OpKernelContext* ctx, const std::vector<Piece>& pieces, bool parallel = true) {
    size_t total = 0;
    for (const Piece& p : pieces) total += p.size;
    const auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
    if (!parallel || total < kParallelCopyBytes || threads->workers == nullptr || threads->num_threads < 2) {
      for (const Piece& p : pieces) memcpy(p.to, p.from, p.size);
      return;
    }
    std::vector<Piece> blocks;
    for (const Piece& p : pieces) {
      for (size_t at = 0; at < p.size; at += kCopyBlockBytes) {
        blocks.push_back({p.to + at, p.from + at, std::min(kCopyBlockBytes, p.size - at)});
      }
    }
    const int64_t n = static_cast<int64_t>(blocks.size());
    threads->workers->ParallelFor(
        n, tsl::thread::ThreadPool::SchedulingParams::Fixed((n + threads->num_threads - 1) / threads->num_threads),
        [&blocks](int64_t begin, int64_t end) {
          for (int64_t b = begin; b < end; ++b) memcpy(blocks[b].to, blocks[b].from, blocks[b].size);
        });
  }

  // Makes ``output`` the output segment's mapping, with a place for each output that lies in it, aligned as TF's
  // tensors are (the others are copied out), and lets go of the previous ones.
  void Hold(std::shared_ptr<Shared> output) {
    Release();
    output_ = std::move(output);
    for (int i = 0; i < num_outputs(); ++i) {
      PartialTensorShape shape = shapes_[i];
      int64_t bytes = shape.num_elements() * tensorflow::DataTypeSize(output_type(i));
      char* at = output_->data + output_offsets_[i];
      bool fits = shape.IsFullyDefined() && bytes > 0 && output_offsets_[i] >= 0 &&
                  static_cast<size_t>(output_offsets_[i] + bytes) <= output_bytes_ &&
                  reinterpret_cast<uintptr_t>(at) % kAlignBytes == 0;
      places_.push_back(fits ? new Place(output_, at, static_cast<size_t>(bytes)) : nullptr);
    }
  }

  void Release() {
    for (Place* place : places_) {
      if (place != nullptr) place->Unref();
    }
    places_.clear();
    output_.reset();
  }

  // Outputs TF still holds keep the bytes they have, in memory of their own: a private copy replaces the pages
  // under them in one step (mremap onto their addresses: a reader sees the same bytes before and after), and the
  // segment is mapped anew, elsewhere, for this call (mremap of a shared mapping with old size 0 maps the same
  // pages again). The old mapping goes with the last of those outputs.
  absl::Status Detach() {
    const size_t size = output_->size;
    void* fresh = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (fresh == MAP_FAILED) return absl::ResourceExhaustedError(std::string("xreduce: no memory to keep the "
                                                                             "previous call's outputs: ") + strerror(errno));
    memcpy(fresh, output_->data, size);
    void* again = mremap(output_->data, 0, size, MREMAP_MAYMOVE);
    if (again == MAP_FAILED) {
      munmap(fresh, size);
      return absl::InternalError(std::string("xreduce: cannot map the output segment again: ") + strerror(errno));
    }
    if (mremap(fresh, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, output_->data) == MAP_FAILED) {
      munmap(fresh, size);
      munmap(again, size);
      return absl::InternalError(std::string("xreduce: cannot keep the previous call's outputs: ") + strerror(errno));
    }
    auto output = std::make_shared<Shared>();
    output->data = static_cast<char*>(again);
    output->size = size;
    Hold(std::move(output));
    detaches.fetch_add(1, std::memory_order_relaxed);
    return absl::OkStatus();
  }

  std::string Where() const { return "xreduce daemon at " + daemon_ + " (local lane " + address_ + ")"; }

  absl::Status Broke(const std::string& what) const {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return absl::DeadlineExceededError("BatchReduce to the " + Where() + " got no answer within " +
                                         std::to_string(timeout_) + "s");
    }
    return absl::UnavailableError(Where() + " is unavailable: " + what + " (" + strerror(errno) + ")");
  }

  absl::Status Connect() {
    fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return Broke("no socket");
    struct timeval tv;
    double seconds = timeout_ > 0 ? timeout_ : 3600.0;
    tv.tv_sec = static_cast<time_t>(seconds);
    tv.tv_usec = static_cast<suseconds_t>((seconds - std::floor(seconds)) * 1e6);
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    socklen_t len;
    const std::string abstract = "unix-abstract:", path = "unix:";
    if (address_.compare(0, abstract.size(), abstract) == 0) {
      std::string name = address_.substr(abstract.size());
      if (name.size() + 1 > sizeof(addr.sun_path)) return absl::InvalidArgumentError("xreduce: lane name too long");
      memcpy(addr.sun_path + 1, name.data(), name.size());
      len = static_cast<socklen_t>(offsetof(struct sockaddr_un, sun_path) + 1 + name.size());
    } else if (address_.compare(0, path.size(), path) == 0) {
      std::string name = address_.substr(path.size());
      if (name.size() + 1 > sizeof(addr.sun_path)) return absl::InvalidArgumentError("xreduce: lane path too long");
      memcpy(addr.sun_path, name.data(), name.size());
      len = static_cast<socklen_t>(offsetof(struct sockaddr_un, sun_path) + name.size() + 1);
    } else {
      return absl::InvalidArgumentError("xreduce: address must be unix:PATH or unix-abstract:NAME; got " + address_);
    }
    if (connect(fd_, reinterpret_cast<struct sockaddr*>(&addr), len) != 0) return Broke("cannot connect");
    std::string reply;
    TF_RETURN_IF_ERROR(Send(hello_, "sending the hello"));
    TF_RETURN_IF_ERROR(Receive(&reply));
    if (reply[0] != 0) {
      return absl::Status(static_cast<absl::StatusCode>(static_cast<unsigned char>(reply[0])),
                          Where() + " refused the connection: " + reply.substr(2));
    }
    return absl::OkStatus();
  }

  // Sends a request frame (in a group, as its next collective), connecting first if need be.
  absl::Status Request(const std::string& request) {
    if (fd_ < 0) TF_RETURN_IF_ERROR(Connect());
    if (sequence_ == nullptr) return Send(request, "it broke during BatchReduce");
    return Send(Numbered(request, __atomic_fetch_add(sequence_, 1, __ATOMIC_SEQ_CST)), "it broke during BatchReduce");
  }

  // The request frame with the group's collective appended, numbered ``sequence``, and its length set again.
  std::string Numbered(const std::string& request, int64_t sequence) const {
    std::string spec = collective_;
    spec.push_back(0x20);  // CollectiveSpec.sequence: field 4, a varint
    Varint(static_cast<uint64_t>(sequence), &spec);
    std::string frame = request;
    frame.push_back(0x3a);  // BatchReduceRequest.collective: field 7, length-delimited
    Varint(spec.size(), &frame);
    frame += spec;
    uint32_t n = static_cast<uint32_t>(frame.size() - 4);
    for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return frame;
  }

  static void Varint(uint64_t value, std::string* out) {
    while (value >= 0x80) {
      out->push_back(static_cast<char>((value & 0x7f) | 0x80));
      value >>= 7;
    }
    out->push_back(static_cast<char>(value));
  }

  absl::Status Send(const std::string& data, const char* what) {
    size_t sent = 0;
    while (sent < data.size()) {
      ssize_t n = send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Broke(what);
      sent += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status ReceiveAll(char* data, size_t size) {
    size_t got = 0;
    while (got < size) {
      ssize_t n = recv(fd_, data + got, size - got, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) {
        errno = ECONNRESET;
        return Broke("the daemon closed the connection");
      }
      if (n < 0) return Broke("it broke during BatchReduce");
      got += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status Receive(std::string* body) {
    unsigned char length[4];
    TF_RETURN_IF_ERROR(ReceiveAll(reinterpret_cast<char*>(length), sizeof(length)));
    uint32_t n = length[0] | (length[1] << 8) | (length[2] << 16) | (static_cast<uint32_t>(length[3]) << 24);
    if (n < 2 || n > kMaxFrameBytes) {
      return absl::UnavailableError(Where() + " sent a reply frame of " + std::to_string(n) + " bytes");
    }
    body->resize(n);
    return ReceiveAll(&(*body)[0], n);
  }

  void Hangup() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  std::mutex mu_;
  std::vector<PartialTensorShape> shapes_;
  std::string address_, daemon_, hello_, request_, staging_name_, output_name_, collective_;
  std::vector<std::string> phases_;  // the request frame of each phase (one: ``request_``)
  std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges_;  // each phase's bytes of the staging segment
  int64_t* sequence_ = nullptr;
  size_t staging_bytes_ = 0, output_bytes_ = 0;
  std::vector<int64_t> input_offsets_, output_offsets_;
  float timeout_ = 0;
  int fd_ = -1;
  Mapping staging_;
  std::shared_ptr<Shared> output_;
  std::vector<Place*> places_;  // one per output (null: copied out), each with a reference of the kernel's
  absl::Status gave_up_;
};

REGISTER_KERNEL_BUILDER(Name("XreduceLaneCall").Device(tensorflow::DEVICE_CPU), LaneCallOp);

}  // namespace

// The calls this process's kernels made that the daemon answered with results (read through ctypes).
extern "C" int64_t xreduce_lane_kernel_calls() { return calls.load(std::memory_order_relaxed); }

// The calls that first moved results TF still held to memory of their own.
extern "C" int64_t xreduce_lane_kernel_detaches() { return detaches.load(std::memory_order_relaxed); }

// Those calls' nanoseconds copying in, exchanging with the daemon and copying out, into out[0..2].
extern "C" void xreduce_lane_kernel_nanos(int64_t* out) {
  out[0] = copy_in_ns.load(std::memory_order_relaxed);
  out[1] = exchange_ns.load(std::memory_order_relaxed);
  out[2] = copy_out_ns.load(std::memory_order_relaxed);
}

// The next number of a process's sequence counter (the kernels' and Python's collectives share it).
extern "C" int64_t xreduce_next_sequence(int64_t* counter) { return __atomic_fetch_add(counter, 1, __ATOMIC_SEQ_CST); }
