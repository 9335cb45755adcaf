// The coalesce.v1.Generator service on gRPC's callback API. Its methods take
// their requests as raw bytes (service/request_parser.h says why) and hand
// the work that can take long, parsing and tokenizing, to a WorkPool, so
// gRPC's threads only ever route messages. A prepared request goes to the
// engine loop, and each request's output streams through its own reactor:
// the engine appends to the reactor's outbox and never waits for the network.
#pragma once

#include <atomic>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "batcher/engine_loop.h"
#include "chat/chat_template.h"
#include "coalesce/v1/generator.grpc.pb.h"
#include "engine/backend.h"
#include "engine/tokenizer/tokenizer.h"
#include "metrics/server_metrics.h"
#include "service/tenants.h"
#include "service/validation.h"
#include "service/work_pool.h"

namespace coalesce::service {

class GenerateReactor;

struct GeneratorServiceOptions {
  int max_batch_size = batcher::SchedulerConfig{}.max_batch_size;  // reported by GetModelInfo
  // Threads that parse and tokenize requests, and how many requests may
  // wait for them before more are refused (RESOURCE_EXHAUSTED).
  int work_threads = 2;
  int max_pending_work = batcher::EngineLoopOptions{}.max_queue;
  // A Generate stream whose client reads nothing for this long, while the
  // engine still generates for it, is ended (see GenerateReactor).
  absl::Duration stream_stall_timeout = absl::InfiniteDuration();
  // The model's chat template, for Generate's `messages` and
  // ApplyChatTemplate; null when it has none, and then `chat_unavailable`
  // says why (FAILED_PRECONDITION's message). bos_token and eos_token of
  // `chat_options` are the template's variables.
  const chat::ChatTemplate* chat_template = nullptr;
  std::string chat_unavailable;
  chat::ChatRenderOptions chat_options;
  // --api_keys_file: every Generator call must name a tenant, and Generate
  // is held to its limits. Null: no authentication.
  Tenants* tenants = nullptr;
  // --split_special_tokens: the default of the requests'
  // split_special_tokens (a tenant's setting overrides both).
  bool split_special_tokens = false;
};

using RawGeneratorService = v1::Generator::WithRawCallbackMethod_Generate<
    v1::Generator::WithRawCallbackMethod_GetModelInfo<v1::Generator::WithRawCallbackMethod_Tokenize<
        v1::Generator::WithRawCallbackMethod_Detokenize<
            v1::Generator::WithRawCallbackMethod_ApplyChatTemplate<v1::Generator::Service>>>>>;

class GeneratorService final : public RawGeneratorService {
 public:
  // Everything passed in must outlive the service. `metrics` may be null.
  GeneratorService(batcher::EngineLoop* loop, const engine::Tokenizer* tokenizer,
                   const engine::Backend* backend, GeneratorServiceOptions options,
                   metrics::ServerMetrics* metrics);

  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ApplyChatTemplate(grpc::CallbackServerContext* context,
                                              const grpc::ByteBuffer* request,
                                              grpc::ByteBuffer* response) override;

  // Waits until no Generate call is in progress, or until `deadline`;
  // returns whether none is.
  bool WaitForGenerateCalls(absl::Time deadline);

 private:
  // Parses, validates and tokenizes a Generate request and submits it; on
  // the work pool.
  void PrepareAndSubmit(GenerateReactor* reactor, const grpc::CallbackServerContext& context,
                        const grpc::ByteBuffer& raw, absl::Time arrival);
  // Turns a valid request into the engine's form, or says why it is invalid.
  // `rejection` names the reason for the rejection metric on error.
  absl::StatusOr<batcher::GenerationRequest> Prepare(const grpc::CallbackServerContext& context,
                                                     const v1::GenerateRequest& request,
                                                     const Tenants::Caller& caller,
                                                     absl::Time arrival,
                                                     std::string_view* rejection) const;
  // The conversation rendered with the chat template, with the ranges of
  // the template's own text, or why it cannot be: FAILED_PRECONDITION
  // without a template, INVALID_ARGUMENT for messages the limits or the
  // template refuse (raise_exception's own message) and for a role that
  // holds a special token.
  absl::StatusOr<chat::RenderedChat> RenderChat(
      const google::protobuf::RepeatedPtrField<v1::ChatMessage>& messages,
      bool add_generation_prompt) const;
  // Whether a request's special tokens are text: its tenant's setting, else
  // the request's split_special_tokens, else the server's default.
  bool SplitSpecialTokens(bool has_request_value, bool request_value,
                          const Tenants::Caller& caller) const;
  // A request's text tokenized: with `split`, special tokens count only
  // inside `special_ranges` (a rendered conversation's template_ranges; a
  // prompt has none). Nothing when it takes more than `max_tokens`.
  std::optional<std::vector<int32_t>> Encode(std::string_view text, bool add_special_tokens,
                                             bool split, std::span<const ByteRange> special_ranges,
                                             size_t max_tokens) const;
  // The caller's tenant, with --api_keys_file: from the `authorization`
  // metadata, or a verified client certificate's subject. Without the file,
  // a nameless caller.
  absl::StatusOr<Tenants::Caller> Authenticate(const grpc::CallbackServerContext& context) const;
  // Runs `job` on the work pool, or finishes the unary call with
  // RESOURCE_EXHAUSTED when the pool is full.
  void PostUnary(grpc::ServerUnaryReactor* reactor, grpc::CallbackServerContext* context,
                 const grpc::ByteBuffer& request, std::function<void()> job);
  // Where a unary call's body runs: on the work pool, or on gRPC's thread
  // for one that takes no time (it is then answered even when the pool is
  // full).
  enum class UnaryLane { kWorkPool, kGrpcThread };
  // Every unary method: authenticates the caller on gRPC's thread (an
  // unknown one ends the call there), then, in `lane`, parses the request as
  // a `Request`, runs `body(request, caller)`, which returns the response
  // message or the call's error, and finishes the call with it.
  template <typename Request, typename Body>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                                  UnaryLane lane, Body body);
  bool NoGenerateCalls() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) {
    return generate_calls_ == 0;
  }

  batcher::EngineLoop* const loop_;
  const engine::Tokenizer* const tokenizer_;
  const engine::Backend* const backend_;
  const GeneratorServiceOptions options_;
  metrics::ServerMetrics* const metrics_;
  const RequestLimits limits_;

  absl::Mutex calls_mu_;
  int generate_calls_ ABSL_GUARDED_BY(calls_mu_) = 0;  // started, not yet done

  // Last: destroyed first, running what is queued while the rest still
  // lives (gRPC has finished every call by then, so nothing is queued).
  WorkPool pool_;
};

}  // namespace coalesce::service
