// The coalesce.v1.Generator service on gRPC's callback API. It validates and
// tokenizes requests, submits them to the engine loop, and streams each
// request's output through its own reactor: the engine appends to the
// reactor's outbox and never waits for the network.
#pragma once

#include <atomic>
#include <string>

#include "batcher/engine_loop.h"
#include "coalesce/v1/generator.grpc.pb.h"
#include "engine/backend.h"
#include "engine/tokenizer.h"
#include "metrics/server_metrics.h"
#include "service/validation.h"

namespace coalesce::service {

class GeneratorService final : public v1::Generator::CallbackService {
 public:
  // Everything passed in must outlive the service. `metrics` may be null.
  GeneratorService(batcher::EngineLoop* loop, const engine::Tokenizer* tokenizer,
                   const engine::Backend* backend, int max_batch_size,
                   metrics::ServerMetrics* metrics);

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const v1::TokenizeRequest* request,
                                     v1::TokenizeResponse* response) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* context,
                                       const v1::DetokenizeRequest* request,
                                       v1::DetokenizeResponse* response) override;

 private:
  // Turns a valid request into the engine's form, or says why it is invalid.
  // `rejection` names the reason for the rejection metric on error.
  absl::StatusOr<batcher::GenerationRequest> Prepare(const grpc::CallbackServerContext& context,
                                                     const v1::GenerateRequest& request,
                                                     std::string_view* rejection) const;

  batcher::EngineLoop* const loop_;
  const engine::Tokenizer* const tokenizer_;
  const engine::Backend* const backend_;
  const int max_batch_size_;
  metrics::ServerMetrics* const metrics_;
  const RequestLimits limits_;
};

// absl::Status -> grpc::Status (the codes are the same numbers).
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace coalesce::service
