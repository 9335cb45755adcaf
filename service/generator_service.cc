#include "service/generator_service.h"

#include <algorithm>
#include <limits>
#include <random>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "service/generate_reactor.h"
#include "service/grpc_status.h"
#include "service/request_parser.h"

namespace coalesce::service {

namespace {
std::string StatusName(const absl::Status& status) {
  return absl::AsciiStrToLower(absl::StatusCodeToString(status.code()));
}

uint64_t RandomSeed() {
  thread_local std::mt19937_64 generator{std::random_device{}()};
  return generator();
}

// Requests this large (a prompt of some 16k tokens and more) take the work
// pool's large lane, which never holds up small ones.
bool IsLarge(const grpc::ByteBuffer& request) { return request.Length() > (64 << 10); }

absl::Status PoolFull(int queued) {
  return absl::ResourceExhaustedError(
      absl::StrCat("the server is overloaded: ", queued,
                   " requests are already waiting to be parsed and tokenized; retry after a "
                   "short pause"));
}
}  // namespace

GeneratorService::GeneratorService(batcher::EngineLoop* loop, const engine::Tokenizer* tokenizer,
                                   const engine::Backend* backend, GeneratorServiceOptions options,
                                   metrics::ServerMetrics* metrics)
    : loop_(loop),
      tokenizer_(tokenizer),
      backend_(backend),
      options_(options),
      metrics_(metrics),
      limits_{.vocab_size = backend->config().vocab_size,
              .context_length = backend->config().max_seq_len},
      pool_(options.work_threads, options.max_pending_work) {}

bool GeneratorService::WaitForGenerateCalls(absl::Time deadline) {
  absl::MutexLock lock(&calls_mu_);
  return calls_mu_.AwaitWithDeadline(absl::Condition(this, &GeneratorService::NoGenerateCalls),
                                     deadline);
}

bool GeneratorService::SplitSpecialTokens(bool has_request_value, bool request_value,
                                          const Tenants::Caller& caller) const {
  if (caller.split_special_tokens) return true;
  return has_request_value ? request_value : options_.split_special_tokens;
}

std::optional<std::vector<int32_t>> GeneratorService::Encode(
    std::string_view text, bool add_special_tokens, bool split,
    std::span<const ByteRange> special_ranges, size_t max_tokens) const {
  if (!split) return tokenizer_->EncodeAtMost(text, add_special_tokens, max_tokens);
  return tokenizer_->EncodeSplitAtMost(text, add_special_tokens, special_ranges, max_tokens);
}

absl::StatusOr<batcher::GenerationRequest> GeneratorService::Prepare(
    const grpc::CallbackServerContext& context, const v1::GenerateRequest& request,
    const Tenants::Caller& caller, absl::Time arrival, std::string_view* rejection) const {
  *rejection = "invalid";
  if (absl::Status s = ValidateGenerateRequest(request, limits_); !s.ok()) return s;
  batcher::GenerationRequest out;
  out.arrival = arrival;
  if (context.deadline() != std::chrono::system_clock::time_point::max()) {
    out.deadline = absl::FromChrono(context.deadline());
  }
  out.request_id = request.request_id();
  out.cache_salt = request.cache_salt();
  if (request.prompt_token_ids_size() == 0) {
    // A conversation is rendered into text, which the template has given
    // its special tokens (so none is added); a prompt gets the tokenizer's.
    const bool chat = request.messages_size() > 0;
    chat::RenderedChat rendered;
    if (chat) {
      absl::StatusOr<chat::RenderedChat> text = RenderChat(request.messages(), true);
      if (!text.ok()) return text.status();  // rejection "invalid"
      rendered = *std::move(text);
    }
    const std::string& prompt = chat ? rendered.text : request.prompt();
    // With split_special_tokens only the template's own special tokens
    // count; a prompt is all the client's.
    const bool split = SplitSpecialTokens(request.has_split_special_tokens(),
                                          request.split_special_tokens(), caller);
    // Tokenized only as far as the context can hold: a longer prompt is
    // refused without being tokenized in full.
    const int room = limits_.context_length - request.max_new_tokens();
    std::optional<std::vector<int32_t>> ids =
        Encode(prompt, /*add_special_tokens=*/!chat, split, rendered.template_ranges,
               static_cast<size_t>(std::max(room, 0)));
    if (!ids.has_value()) {
      // A short prompt is counted exactly for the message; a long one only
      // as far as it had to be.
      constexpr size_t kCountUpTo = 64 << 10;  // bytes of text
      *rejection = "too_long";
      if (prompt.size() > kCountUpTo) {
        return absl::InvalidArgumentError(absl::StrCat(
            chat ? "the rendered conversation (" : "the prompt (", prompt.size(),
            " bytes: more than ", room, " tokens) plus max_new_tokens (", request.max_new_tokens(),
            ") exceeds the context length of ", limits_.context_length, " tokens"));
      }
      out.prompt =
          *Encode(prompt, /*add_special_tokens=*/!chat, split, rendered.template_ranges, SIZE_MAX);
    } else {
      out.prompt = *std::move(ids);
    }
    if (out.prompt.empty()) {
      return absl::InvalidArgumentError(
          request.prompt().empty()
              ? "the prompt is empty and this model's tokenizer adds no BOS token to start "
                "from: set prompt or prompt_token_ids"
              : "the prompt encodes to no tokens: set a prompt that does, or prompt_token_ids");
    }
  } else {
    out.prompt.assign(request.prompt_token_ids().begin(), request.prompt_token_ids().end());
  }
  if (absl::Status s = ValidatePromptLength(static_cast<int>(out.prompt.size()),
                                            request.max_new_tokens(), limits_);
      !s.ok()) {
    *rejection = "too_long";
    return s;
  }
  out.max_new_tokens = request.max_new_tokens();
  const v1::SamplingParams& sampling = request.sampling();
  out.sampling.temperature = sampling.temperature();
  out.sampling.top_k = sampling.top_k();
  out.sampling.top_p = sampling.has_top_p() ? sampling.top_p() : 1.0f;
  out.sampling.min_p = sampling.min_p();
  out.controls.repetition_penalty =
      sampling.has_repetition_penalty() ? sampling.repetition_penalty() : 1.0f;
  out.controls.frequency_penalty = sampling.frequency_penalty();
  out.controls.presence_penalty = sampling.presence_penalty();
  // By id: a map's order is unspecified, the bias's must not be.
  out.controls.logit_bias.assign(sampling.logit_bias().begin(), sampling.logit_bias().end());
  std::sort(out.controls.logit_bias.begin(), out.controls.logit_bias.end());
  out.min_tokens = sampling.min_tokens();
  out.ignore_eos = sampling.ignore_eos();
  out.stop_token_ids.assign(sampling.stop_token_ids().begin(), sampling.stop_token_ids().end());
  out.seed = sampling.has_seed() ? sampling.seed() : RandomSeed();
  out.stop.assign(request.stop().begin(), request.stop().end());
  out.priority = request.priority();
  out.n = std::max(request.n(), 1);
  out.logprobs = request.logprobs();
  out.top_logprobs = request.top_logprobs();
  out.prompt_logprobs = request.prompt_logprobs();
  return out;
}

absl::StatusOr<chat::RenderedChat> GeneratorService::RenderChat(
    const google::protobuf::RepeatedPtrField<v1::ChatMessage>& messages,
    bool add_generation_prompt) const {
  if (absl::Status s = ValidateMessages(messages, limits_); !s.ok()) return s;
  if (absl::Status s = ValidateRoles(messages, *tokenizer_); !s.ok()) return s;
  if (options_.chat_template == nullptr) {
    return absl::FailedPreconditionError(options_.chat_unavailable);
  }
  std::vector<chat::ChatMessage> conversation;
  conversation.reserve(static_cast<size_t>(messages.size()));
  for (const v1::ChatMessage& m : messages) conversation.push_back({m.role(), m.content()});
  chat::ChatRenderOptions render = options_.chat_options;
  render.add_generation_prompt = add_generation_prompt;
  absl::StatusOr<chat::RenderedChat> text =
      options_.chat_template->RenderTracked(conversation, render);
  if (!text.ok() && text.status().code() == absl::StatusCode::kResourceExhausted) {
    // The template ran into its bounds on this conversation: the request's
    // doing, as far as the client can act on it.
    return absl::InvalidArgumentError(absl::StrCat(
        "the chat template could not render these messages: ", text.status().message()));
  }
  return text;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* GeneratorService::Generate(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  {
    absl::MutexLock lock(&calls_mu_);
    ++generate_calls_;
  }
  GenerateReactor::Options reactor_options;
  reactor_options.stall_timeout = options_.stream_stall_timeout;
  reactor_options.tokenizer = tokenizer_;
  reactor_options.on_stall = [this] {
    if (metrics_ != nullptr) metrics_->OnStalledStream();
  };
  reactor_options.on_done = [this] {
    absl::MutexLock lock(&calls_mu_);
    --generate_calls_;
  };
  auto* reactor = new GenerateReactor(context, loop_, std::move(reactor_options));
  // gRPC keeps the request and the context until the call is finished,
  // which only the job (or a refusal here) does. The request's time in the
  // work pool counts as queue time, on the clock the loop schedules by.
  const absl::Time arrival = loop_->clock().Now();
  if (!pool_.TryPost([this, reactor, context, request,
                      arrival] { PrepareAndSubmit(reactor, *context, *request, arrival); },
                     IsLarge(*request))) {
    if (metrics_ != nullptr) {
      metrics_->OnRejected("queue_full");
      metrics_->CountEndedBeforeEngine("resource_exhausted");
    }
    reactor->Reject(PoolFull(options_.max_pending_work));
  }
  return reactor;
}

void GeneratorService::PrepareAndSubmit(GenerateReactor* reactor,
                                        const grpc::CallbackServerContext& context,
                                        const grpc::ByteBuffer& raw, absl::Time arrival) {
  absl::Status status;
  std::string_view rejection = "invalid";
  v1::GenerateRequest request;
  if (reactor->cancelled()) {
    status = absl::CancelledError("the client cancelled the request");
  } else if (status = ParseRequest(raw, &request); status.ok()) {
    reactor->set_request_id(request.request_id());
    absl::StatusOr<Tenants::Caller> caller = Authenticate(context);
    if (!caller.ok()) rejection = "unauthenticated";
    absl::StatusOr<batcher::GenerationRequest> prepared =
        caller.ok() ? Prepare(context, request, *caller, arrival, &rejection) : caller.status();
    if (prepared.ok() && options_.tenants != nullptr) {
      // The tenant's limits (the most tokens the call can use are reserved
      // from its budget until it ends), then its priority cap.
      const int64_t most = static_cast<int64_t>(prepared->prompt.size()) +
                           int64_t{prepared->max_new_tokens} * prepared->n;
      absl::Duration retry_after;
      absl::StatusOr<std::unique_ptr<Tenants::Stream>> stream =
          options_.tenants->Open(caller->name, most, &retry_after);
      if (!stream.ok()) {
        if (metrics_ != nullptr) {
          metrics_->OnRejected("tenant_limit");
          metrics_->CountEndedBeforeEngine(StatusName(stream.status()), caller->name);
        }
        reactor->Reject(stream.status(), retry_after);
        return;
      }
      reactor->set_tenant_stream(*std::move(stream));
      prepared->tenant = caller->name;
      prepared->tenant_weight = caller->weight;
      prepared->cache_partition = caller->cache_partition;
      prepared->priority = std::min(prepared->priority, caller->max_priority);
    }
    // The engine loop counts its own rejections.
    status = prepared.ok() ? reactor->Submit(*std::move(prepared)) : prepared.status();
    if (!prepared.ok() && metrics_ != nullptr) metrics_->OnRejected(rejection);
  } else if (metrics_ != nullptr) {
    metrics_->OnRejected(rejection);
  }
  if (status.ok()) return;
  // Counted before the client can see the error.
  if (metrics_ != nullptr) metrics_->CountEndedBeforeEngine(StatusName(status));
  reactor->Reject(status);
}

absl::StatusOr<Tenants::Caller> GeneratorService::Authenticate(
    const grpc::CallbackServerContext& context) const {
  if (options_.tenants == nullptr) return Tenants::Caller{};
  std::string_view authorization;
  const auto& metadata = context.client_metadata();
  if (const auto it = metadata.find("authorization"); it != metadata.end()) {
    authorization = std::string_view(it->second.data(), it->second.size());
  }
  std::string subject;
  if (const auto auth = context.auth_context(); auth != nullptr) {
    for (const grpc::string_ref& value : auth->FindPropertyValues("x509_subject")) {
      subject.assign(value.data(), value.size());
    }
  }
  return options_.tenants->Authenticate(authorization, subject);
}

void GeneratorService::PostUnary(grpc::ServerUnaryReactor* reactor,
                                 grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer& request, std::function<void()> job) {
  if (!pool_.TryPost(std::move(job), IsLarge(request))) {
    context->AddTrailingMetadata("grpc-retry-pushback-ms", "1000");
    reactor->Finish(ToGrpcStatus(PoolFull(options_.max_pending_work)));
  }
}

template <typename Request, typename Body>
grpc::ServerUnaryReactor* GeneratorService::Unary(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response, UnaryLane lane,
                                                  Body body) {
  auto* reactor = context->DefaultReactor();
  absl::StatusOr<Tenants::Caller> caller = Authenticate(*context);
  if (!caller.ok()) {
    reactor->Finish(ToGrpcStatus(caller.status()));
    return reactor;
  }
  // gRPC keeps the request and the response until the call is finished,
  // which only this does.
  auto run = [reactor, request, response, caller = *std::move(caller), body = std::move(body)] {
    Request parsed;
    absl::Status status = ParseRequest(*request, &parsed);
    if (status.ok()) {
      const auto out = body(parsed, caller);
      if (out.ok()) *response = SerializeMessage(*out);
      status = out.status();
    }
    reactor->Finish(ToGrpcStatus(status));
  };
  if (lane == UnaryLane::kGrpcThread) {
    run();
  } else {
    PostUnary(reactor, context, *request, std::move(run));
  }
  return reactor;
}

grpc::ServerUnaryReactor* GeneratorService::GetModelInfo(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response) {
  return Unary<v1::GetModelInfoRequest>(
      context, request, response, UnaryLane::kGrpcThread,
      [this](const v1::GetModelInfoRequest&,
             const Tenants::Caller&) -> absl::StatusOr<v1::ModelInfo> {
        const engine::ModelConfig& config = backend_->config();
        v1::ModelInfo info;
        info.set_name(config.name);
        info.set_path(config.source);
        info.set_architecture(config.architecture);
        info.set_vocab_size(config.vocab_size);
        info.set_context_length(config.max_seq_len);
        info.set_backend(std::string(backend_->name()));
        info.set_synthetic(config.synthetic);
        info.set_num_parameters(config.num_parameters());
        info.set_num_layers(config.n_layers);
        info.set_hidden_size(config.dim);
        info.set_num_attention_heads(config.n_heads);
        info.set_num_key_value_heads(config.n_kv_heads);
        for (int32_t id : tokenizer_->eos_ids()) info.add_eos_token_ids(id);
        info.set_bos_token_id(tokenizer_->bos_id());
        info.set_max_batch_size(options_.max_batch_size);
        info.set_has_chat_template(options_.chat_template != nullptr);
        return info;
      });
}

grpc::ServerUnaryReactor* GeneratorService::Tokenize(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) {
  return Unary<v1::TokenizeRequest>(
      context, request, response, UnaryLane::kWorkPool,
      [this](const v1::TokenizeRequest& parsed,
             const Tenants::Caller& caller) -> absl::StatusOr<v1::TokenizeResponse> {
        const bool split = SplitSpecialTokens(parsed.has_split_special_tokens(),
                                              parsed.split_special_tokens(), caller);
        const std::vector<int32_t> ids =
            *Encode(parsed.text(), parsed.add_special_tokens(), split, {}, SIZE_MAX);
        v1::TokenizeResponse out;
        out.mutable_token_ids()->Add(ids.begin(), ids.end());
        return out;
      });
}

grpc::ServerUnaryReactor* GeneratorService::Detokenize(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  return Unary<v1::DetokenizeRequest>(
      context, request, response, UnaryLane::kWorkPool,
      [this](const v1::DetokenizeRequest& parsed,
             const Tenants::Caller&) -> absl::StatusOr<v1::DetokenizeResponse> {
        const auto& ids = parsed.token_ids();
        const std::span<const int32_t> span(ids.data(), static_cast<size_t>(ids.size()));
        if (absl::Status s = ValidateTokenIds(span, limits_.vocab_size, "token_ids"); !s.ok()) {
          return s;
        }
        v1::DetokenizeResponse out;
        out.set_text(engine::Decode(*tokenizer_, span));
        return out;
      });
}

grpc::ServerUnaryReactor* GeneratorService::ApplyChatTemplate(grpc::CallbackServerContext* context,
                                                              const grpc::ByteBuffer* request,
                                                              grpc::ByteBuffer* response) {
  return Unary<v1::ApplyChatTemplateRequest>(
      context, request, response, UnaryLane::kWorkPool,
      [this](const v1::ApplyChatTemplateRequest& parsed,
             const Tenants::Caller& caller) -> absl::StatusOr<v1::ApplyChatTemplateResponse> {
        absl::StatusOr<chat::RenderedChat> text =
            RenderChat(parsed.messages(), parsed.add_generation_prompt());
        if (!text.ok()) return text.status();
        const bool split = SplitSpecialTokens(parsed.has_split_special_tokens(),
                                              parsed.split_special_tokens(), caller);
        const std::vector<int32_t> ids = *Encode(text->text, /*add_special_tokens=*/false, split,
                                                 text->template_ranges, SIZE_MAX);
        v1::ApplyChatTemplateResponse out;
        out.mutable_token_ids()->Add(ids.begin(), ids.end());
        out.set_text(std::move(text->text));
        return out;
      });
}

}  // namespace coalesce::service
