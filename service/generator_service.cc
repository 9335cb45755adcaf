#include "service/generator_service.h"

#include <random>

#include "absl/strings/ascii.h"
#include "absl/time/clock.h"
#include "service/generate_reactor.h"

namespace coalesce::service {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

namespace {
std::string StatusName(const absl::Status& status) {
  return absl::AsciiStrToLower(absl::StatusCodeToString(status.code()));
}

uint64_t RandomSeed() {
  thread_local std::mt19937_64 generator{std::random_device{}()};
  return generator();
}
}  // namespace

GeneratorService::GeneratorService(batcher::EngineLoop* loop, const engine::Tokenizer* tokenizer,
                                   const engine::Backend* backend, int max_batch_size,
                                   metrics::ServerMetrics* metrics)
    : loop_(loop),
      tokenizer_(tokenizer),
      backend_(backend),
      max_batch_size_(max_batch_size),
      metrics_(metrics),
      limits_{.vocab_size = backend->config().vocab_size,
              .context_length = backend->config().max_seq_len} {}

absl::StatusOr<batcher::GenerationRequest> GeneratorService::Prepare(
    const grpc::CallbackServerContext& context, const v1::GenerateRequest& request,
    std::string_view* rejection) const {
  *rejection = "invalid";
  if (absl::Status s = ValidateGenerateRequest(request, limits_); !s.ok()) return s;
  batcher::GenerationRequest out;
  out.arrival = absl::Now();
  if (context.deadline() != std::chrono::system_clock::time_point::max()) {
    out.deadline = absl::FromChrono(context.deadline());
  }
  out.request_id = request.request_id();
  if (!request.prompt().empty()) {
    out.prompt = tokenizer_->Encode(request.prompt(), /*add_special_tokens=*/true);
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
  out.seed = sampling.has_seed() ? sampling.seed() : RandomSeed();
  out.stop.assign(request.stop().begin(), request.stop().end());
  out.priority = request.priority();
  return out;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* GeneratorService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  auto* reactor = new GenerateReactor(context, loop_, request->request_id());
  std::string_view rejection;
  absl::StatusOr<batcher::GenerationRequest> prepared = Prepare(*context, *request, &rejection);
  absl::Status status = prepared.status();
  if (status.ok()) {
    // Finishes the RPC on error; the engine loop counts its own rejections.
    status = reactor->Submit(*std::move(prepared));
  } else {
    reactor->Reject(status);
    if (metrics_ != nullptr) metrics_->OnRejected(rejection);
  }
  if (!status.ok() && metrics_ != nullptr) metrics_->CountEndedBeforeEngine(StatusName(status));
  return reactor;
}

grpc::ServerUnaryReactor* GeneratorService::GetModelInfo(grpc::CallbackServerContext* context,
                                                         const v1::GetModelInfoRequest*,
                                                         v1::ModelInfo* response) {
  const engine::ModelConfig& config = backend_->config();
  response->set_name(config.name);
  response->set_path(config.source);
  response->set_architecture(config.architecture);
  response->set_vocab_size(config.vocab_size);
  response->set_context_length(config.max_seq_len);
  response->set_backend(std::string(backend_->name()));
  response->set_synthetic(config.synthetic);
  response->set_num_parameters(config.num_parameters());
  response->set_num_layers(config.n_layers);
  response->set_hidden_size(config.dim);
  response->set_num_attention_heads(config.n_heads);
  response->set_num_key_value_heads(config.n_kv_heads);
  for (int32_t id : tokenizer_->eos_ids()) response->add_eos_token_ids(id);
  response->set_bos_token_id(tokenizer_->bos_id());
  response->set_max_batch_size(max_batch_size_);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* GeneratorService::Tokenize(grpc::CallbackServerContext* context,
                                                     const v1::TokenizeRequest* request,
                                                     v1::TokenizeResponse* response) {
  for (int32_t id : tokenizer_->Encode(request->text(), request->add_special_tokens())) {
    response->add_token_ids(id);
  }
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* GeneratorService::Detokenize(grpc::CallbackServerContext* context,
                                                       const v1::DetokenizeRequest* request,
                                                       v1::DetokenizeResponse* response) {
  const auto& ids = request->token_ids();
  const std::span<const int32_t> span(ids.data(), static_cast<size_t>(ids.size()));
  absl::Status status = ValidateTokenIds(span, limits_.vocab_size, "token_ids");
  if (status.ok()) response->set_text(engine::Decode(*tokenizer_, span));
  auto* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace coalesce::service
