//! `kvserve serve`: the engine on its own thread behind SGLang's and OpenAI's HTTP APIs
//! (`crate::server`), until Ctrl-C.

use std::sync::Arc;

use crate::cli::ServeArgs;
use crate::disagg::{DisaggregationMode, LocalKv, PdOptions};
use crate::engine_loop::pd::{build_pd_side, PdSide};
use crate::engine_loop::EngineHandle;
use crate::error::{EngineError, Result};
use crate::kv_events::{KvEventsConfig, KvEventsError, PublisherKind, ZmqEventPublisher};
use crate::runtime::{async_runtime, bind};
use crate::server::chat::ChatPrompt;
use crate::server::AppState;
use crate::setup::components::ModelForward;
use crate::setup::ModelSource;

/// `kvserve serve`: builds the engine, listens, serves until Ctrl-C, then shuts down cleanly.
pub fn serve(args: &ServeArgs) -> Result<()> {
    let state = build_server_state(args)?;
    async_runtime()?.block_on(async move {
        let (listener, local) = bind(&args.host, args.port).await?;
        eprintln!("kvserve: serving {} on http://{local}", state.model_name);
        // On Ctrl-C, stop taking connections and end every in-flight request (aborted, its
        // stream closed) so the graceful shutdown does not wait on long generations.
        let engine = state.clone();
        let shutdown = async move {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("kvserve: shutting down; in-flight requests are aborted");
            engine.engine.begin_shutdown();
        };
        crate::server::serve(listener, state, shutdown)
            .await
            .map_err(|source| EngineError::Io {
                path: local.to_string(),
                source,
            })
    })
}

/// The server's shared state for `args`: engine thread started, tokenizer loaded.
pub fn build_server_state(args: &ServeArgs) -> Result<Arc<AppState>> {
    let source = args
        .engine
        .model_path
        .clone()
        .map_or(ModelSource::Tiny, ModelSource::Path);
    let config = source.config()?;
    let name = source.name();
    let (tokenizer, chat_template) = source.tokenizer()?;
    let chat = ChatPrompt::new(chat_template).map_err(|e| EngineError::Model(e.to_string()))?;
    let mut setup = args.engine.setup(config.max_position_embeddings)?;
    setup.scheduler.max_queued_requests = args.max_queued_requests;
    let pd = PdOptions::from_args(&args.disaggregation, &args.host)?;
    // Freed pages are handed out sorted (SGLang's `need_sort` in both PD modes), so a request's
    // pages tend to be consecutive and its transfer coalesces into few blocks.
    setup.scheduler.need_sort = pd.mode.is_disaggregated();
    if pd.mode == DisaggregationMode::Decode {
        // Prefill servers on this host write into the decode server's slots.
        setup.shared_kv = pd.backend == transfer::BackendKind::Shm;
    }
    let kv_events = kv_event_publisher(args.kv_events_config.as_deref())?;
    setup.kv_events = kv_events.is_some();
    let context_len = setup.scheduler.context_len;
    let radix = !args.engine.disable_radix_cache;
    let (sched, mut exec) = crate::setup::build(&setup, radix)?;
    let local = LocalKv {
        model: &name,
        page_size: setup.scheduler.page_size,
        kv_dtype: setup.kv_dtype.name(),
    };
    let pd_side = build_pd_side(&pd, local, &mut exec)?;
    if let Some(PdSide::Prefill(p)) = &pd_side {
        if let Some(addr) = p.bootstrap_addr() {
            eprintln!("kvserve: prefill bootstrap server on http://{addr}");
        }
    }
    // The effective settings, under SGLang's server-argument names, for /get_server_info.
    let cfg = sched.config();
    let server_args = serde_json::json!({
        "model_path": name,
        "backend": setup.backend,
        "kv_cache_dtype": setup.kv_dtype.name(),
        "page_size": cfg.page_size,
        "max_total_num_tokens": sched.allocator().size(),
        "max_running_requests": cfg.max_running_requests,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "max_prefill_tokens": cfg.max_prefill_tokens,
        "schedule_policy": cfg.schedule_policy.as_str(),
        "schedule_conservativeness": cfg.schedule_conservativeness,
        "enable_mixed_chunk": cfg.enable_mixed_chunk,
        "enable_deterministic_inference": setup.enable_deterministic_inference,
        "disable_cuda_graph": setup.cuda_graph.disable_cuda_graph,
        "cuda_graph_max_bs": setup.cuda_graph.cuda_graph_max_bs,
        "cuda_graph_bs": exec.runner().cuda_graph_bs(),
        "cuda_graph_memory_bytes": exec.runner().cuda_graph_memory_bytes(),
        "disable_radix_cache": !radix,
        "radix_eviction_policy": setup.eviction_policy,
        "max_queued_requests": cfg.max_queued_requests,
        "api_key_required": args.api_key.is_some(),
        "disaggregation_mode": pd.mode.name(),
        "disaggregation_transfer_backend": pd.backend.name(),
        "disaggregation_bootstrap_port": pd.bootstrap_port,
        "kv_events_config": args.kv_events_config,
    });
    Ok(Arc::new(AppState {
        server_args,
        engine: EngineHandle::start_with(sched, exec, pd_side, kv_events),
        vocab_size: config.vocab_size,
        eos_token_ids: config.eos_token_ids.clone(),
        tokenizer,
        chat,
        model_name: name,
        context_len,
        api_key: args.api_key.clone(),
        metrics: Default::default(),
        disaggregation_mode: pd.mode,
    }))
}

/// `--kv-events-config`: the ZMQ publisher, bound, when the config names one (`None`: no
/// flag, or the `null` publisher, and the cache records no events).
fn kv_event_publisher(config: Option<&str>) -> Result<Option<ZmqEventPublisher>> {
    let arg = |e: KvEventsError| EngineError::arg("--kv-events-config", e.to_string());
    let Some(text) = config else {
        return Ok(None);
    };
    let cfg = KvEventsConfig::from_arg(text).map_err(arg)?;
    match cfg.publisher_kind() {
        PublisherKind::Null => Ok(None),
        PublisherKind::Zmq => {
            let publisher = ZmqEventPublisher::start(&cfg).map_err(arg)?;
            eprintln!(
                "kvserve: KV events on {}{}",
                publisher.endpoint(),
                publisher
                    .replay_endpoint()
                    .map_or(String::new(), |r| format!(" (replay on {r})"))
            );
            Ok(Some(publisher))
        }
    }
}
