//! `kvserve router`: the router (`crate::router`, regular or PD) on loopback or any address,
//! until Ctrl-C.

use crate::error::Result;
use crate::router::{serve, RouterArgs};
use crate::runtime::{async_runtime, bind};

/// `kvserve router`: validates the flags, listens, routes until Ctrl-C.
pub fn router(args: &RouterArgs) -> Result<()> {
    let config = args.config()?;
    async_runtime()?.block_on(async move {
        let (listener, local) = bind(&args.host, args.port).await?;
        let list = |urls: Vec<String>| urls.join(", ");
        if !config.is_pd() {
            eprintln!(
                "kvserve: router on http://{local}: workers {} ({})",
                list(config.workers.iter().map(ToString::to_string).collect()),
                config.policy.as_str(),
            );
        } else {
            eprintln!(
                "kvserve: PD router on http://{local}: prefill {} ({}), decode {} ({})",
                list(
                    config
                        .prefill
                        .iter()
                        .map(|p| format!("{} bootstrap port {}", p.url, p.bootstrap_port))
                        .collect()
                ),
                config.prefill_policy.as_str(),
                list(config.decode.iter().map(ToString::to_string).collect()),
                config.decode_policy.as_str(),
            );
        }
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("kvserve: router shutting down");
        };
        serve(listener, config, shutdown).await
    })
}
