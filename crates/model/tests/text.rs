//! Tokenizers, streaming detokenization, chat templates, sampling and the `tiny` preset.

use attention::CpuBackend;
use kv_pool::{KvDtype, KvLayout, Slot};
use model::tiny::{random_weights, tiny_config, tiny_model, tiny_tokenizer, TINY_EOS, TINY_SEED};
use model::{
    apply_penalties, argmax, check_logits, check_stop, greedy, stop_string_holdback, AttentionMode,
    ChatMessage, ChatTemplate, ForwardInput, ForwardRequest, IncrementalDecoder, LogitsMode,
    ModelError, ModelRunner, Sampler, SamplingParams, StopReason, TensorSource,
};

#[test]
fn tiktoken_round_trips_multibyte_text() {
    let tok = tiny_tokenizer();
    assert_eq!(tok.vocab_size(), 50_257);
    let text = "naïve café — 東京で寿司 🍣🎉 ok";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(TINY_EOS));
}

#[test]
fn incremental_decoding_never_splits_a_utf8_character() {
    let tok = tiny_tokenizer();
    let text = "héllo 世界 🍣🎉 Ünïcödé ✓ end";
    let ids = tok.encode(text, false).unwrap();
    // Byte-level BPE splits some of these characters over several tokens.
    let split = ids
        .iter()
        .filter(|&&id| tok.decode(&[id], false).unwrap().contains('\u{FFFD}'))
        .count();
    assert!(
        split > 0,
        "the test text should split a character over tokens"
    );
    let mut dec = IncrementalDecoder::new(false);
    let mut streamed = String::new();
    for &id in &ids {
        let piece = dec.step(&tok, id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "emitted a partial character: {piece:?}"
        );
        streamed.push_str(&piece);
        assert!(text.starts_with(&streamed));
    }
    streamed.push_str(&dec.finish(&tok).unwrap());
    assert_eq!(streamed, text);
}

#[test]
fn chat_template_renders_chatml_and_raises() {
    let config = serde_json::json!({
        "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|im_end|>",
        "chat_template": "{% for message in messages %}{% if message.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    })
    .to_string();
    let t = ChatTemplate::from_tokenizer_config(&config)
        .unwrap()
        .unwrap();
    let msgs = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi 👋"),
    ];
    assert_eq!(
        t.apply(&msgs, true).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n"
    );
    let e = t
        .apply(&[ChatMessage::new("tool", "x")], false)
        .unwrap_err();
    assert!(e.to_string().contains("no tools"), "{e}");
    assert!(ChatTemplate::from_tokenizer_config("{}").unwrap().is_none());
    assert!(matches!(
        ChatTemplate::new("{% for %}", "", ""),
        Err(ModelError::ChatTemplate(_))
    ));
}

fn logits() -> Vec<f32> {
    vec![0.5, 2.0, -1.0, 1.5, 0.0, 2.0, -3.0, 1.0]
}

#[test]
fn greedy_is_argmax_and_top_k_1_is_greedy() {
    let l = logits();
    assert_eq!(argmax(&l), 1, "ties go to the lowest index");
    let mut g = Sampler::new(SamplingParams::greedy(), 0).unwrap();
    assert_eq!(g.sample(&l, &[], &[]).unwrap(), 1);
    for seed in 0..20 {
        let p = SamplingParams {
            temperature: 1.3,
            top_k: Some(1),
            seed: Some(seed),
            ..Default::default()
        };
        assert_eq!(Sampler::new(p, 0).unwrap().sample(&l, &[], &[]).unwrap(), 1);
    }
}

/// A row holding NaN or +∞, or only −∞, is refused by greedy and sampled decoding alike, with
/// a count of each, and the refused draw leaves the generator where it was; −∞ (a masked
/// token) is allowed beside finite values. Before, NaN never won the argmax, so an all-NaN
/// row gave token 0 (and an all-−∞ row did too).
#[test]
fn non_finite_logits_are_refused_and_minus_infinity_is_a_masked_token() {
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: Some(5),
        ..Default::default()
    };
    for (row, nan, pos_inf, neg_inf) in [
        (vec![f32::NAN; 8], 8, 0, 0),
        (vec![0.5, f32::NAN, 1.0, 2.0], 1, 0, 0),
        (
            vec![0.5, f32::INFINITY, f32::NEG_INFINITY, f32::NAN],
            1,
            1,
            1,
        ),
        (vec![f32::NEG_INFINITY; 5], 0, 0, 5),
    ] {
        assert!(matches!(
            check_logits(&row),
            Err(ModelError::NonFiniteLogits { nan: n, pos_inf: p, neg_inf: m, len })
                if (n, p, m, len) == (nan, pos_inf, neg_inf, row.len())
        ));
        assert!(greedy(&row).is_err());
        for p in [SamplingParams::greedy(), sampled.clone()] {
            let mut s = Sampler::new(p.clone(), 0).unwrap();
            assert!(matches!(
                s.sample(&row, &[], &[]),
                Err(ModelError::NonFiniteLogits { .. })
            ));
            // The refused draw did not advance the generator.
            let mut fresh = Sampler::new(p, 0).unwrap();
            let l = logits();
            assert_eq!(
                s.sample(&l, &[], &[]).unwrap(),
                fresh.sample(&l, &[], &[]).unwrap()
            );
        }
    }
    assert!(matches!(
        greedy(&[]),
        Err(ModelError::InvalidSampling {
            field: "logits",
            ..
        })
    ));
    let masked = [f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY, 0.5];
    assert_eq!(greedy(&masked).unwrap(), 1);
    let mut s = Sampler::new(sampled, 0).unwrap();
    for _ in 0..32 {
        assert!([1, 3].contains(&s.sample(&masked, &[], &[]).unwrap()));
    }
}

/// A repetition penalty far below 1 divides a positive logit toward +∞; the penalised value is
/// clamped, so sampling still draws from a finite row instead of a NaN softmax.
#[test]
fn an_extreme_repetition_penalty_keeps_the_row_finite() {
    let p = SamplingParams {
        repetition_penalty: 1e-30,
        ..SamplingParams::greedy()
    };
    let mut l = vec![1e9, 2.0, -1.0];
    apply_penalties(&p, &mut l, &[0, 2], &[]);
    assert!(l.iter().all(|v| v.is_finite()), "{l:?}");
    assert_eq!(l[0], f32::MAX);
    // A masked token stays masked under any penalty.
    for penalty in [1e-30, 0.5, 2.0, 1e30] {
        let p = SamplingParams {
            repetition_penalty: penalty,
            ..p.clone()
        };
        let mut l = vec![f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY];
        apply_penalties(&p, &mut l, &[0, 1], &[]);
        assert_eq!(l[0], f32::NEG_INFINITY, "penalty {penalty}");
        assert!(l[1].is_finite(), "penalty {penalty}: {l:?}");
    }
    for temperature in [0.0, 1.0] {
        let p = SamplingParams {
            temperature,
            seed: Some(1),
            ..p.clone()
        };
        let t = Sampler::new(p, 0)
            .unwrap()
            .sample(&[1e9, 2.0, -1.0], &[0, 2], &[]);
        assert_eq!(t.unwrap(), 0, "temperature {temperature}");
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_respects_filters() {
    let l = logits();
    let params = SamplingParams {
        temperature: 0.9,
        top_k: Some(4),
        top_p: 0.95,
        seed: Some(42),
        ..Default::default()
    };
    let draw = |p: &SamplingParams| {
        let mut s = Sampler::new(p.clone(), 7).unwrap();
        (0..64)
            .map(|_| s.sample(&l, &[], &[]).unwrap())
            .collect::<Vec<u32>>()
    };
    let a = draw(&params);
    assert_eq!(a, draw(&params), "same seed, same tokens");
    assert!(a.iter().all(|t| [1, 3, 5, 7].contains(t)), "top-k 4: {a:?}");
    assert!(a.iter().collect::<std::collections::BTreeSet<_>>().len() > 1);
    let other = draw(&SamplingParams {
        seed: Some(43),
        ..params.clone()
    });
    assert_ne!(a, other, "another seed, another sequence");
    // top-p: at a low temperature the two 2.0 logits carry almost all the mass, each just
    // under half of it.
    for (top_p, want) in [(0.4, vec![1]), (0.5, vec![1, 5]), (0.99, vec![1, 5])] {
        let s = Sampler::new(
            SamplingParams {
                temperature: 0.1,
                top_p,
                ..Default::default()
            },
            1,
        )
        .unwrap();
        let kept: Vec<u32> = s.probabilities(&l).iter().map(|p| p.0).collect();
        assert_eq!(kept, want, "top_p {top_p}");
    }
    // min-p: keep tokens with at least half the top probability.
    let s = Sampler::new(
        SamplingParams {
            min_p: 0.5,
            ..Default::default()
        },
        1,
    )
    .unwrap();
    let kept: Vec<u32> = s.probabilities(&l).iter().map(|p| p.0).collect();
    assert_eq!(kept, vec![1, 5, 3], "e^-0.5 ≈ 0.61 ≥ 0.5, e^-1 < 0.5");
}

#[test]
fn penalties_change_logits_as_specified() {
    let mut l = logits();
    let p = SamplingParams {
        repetition_penalty: 2.0,
        ..Default::default()
    };
    apply_penalties(&p, &mut l, &[1, 2], &[2, 99]);
    assert_eq!(l[1], 1.0, "positive logit divided");
    assert_eq!(l[2], -2.0, "negative logit multiplied");
    assert_eq!(l[0], 0.5, "unseen untouched");

    let mut l = logits();
    let p = SamplingParams {
        frequency_penalty: 0.5,
        presence_penalty: 0.25,
        ..Default::default()
    };
    apply_penalties(&p, &mut l, &[0, 0, 0], &[3, 3, 3, 7]);
    assert_eq!(
        l[0], 0.5,
        "prompt tokens do not count for frequency/presence"
    );
    assert_eq!(l[3], 1.5 - 3.0 * 0.5 - 0.25);
    assert_eq!(l[7], 1.0 - 0.5 - 0.25);
    // The penalty can change the greedy choice.
    let mut g = Sampler::new(
        SamplingParams {
            temperature: 0.0,
            presence_penalty: 1.0,
            ..Default::default()
        },
        0,
    )
    .unwrap();
    assert_eq!(g.sample(&logits(), &[], &[1, 5]).unwrap(), 3);
}

#[test]
fn bad_sampling_parameters_are_typed_errors() {
    let cases: Vec<(SamplingParams, &str)> = vec![
        (
            SamplingParams {
                temperature: -0.1,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_k: Some(0),
                ..Default::default()
            },
            "top_k",
        ),
        (
            SamplingParams {
                min_p: -0.5,
                ..Default::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            "repetition_penalty",
        ),
        (
            SamplingParams {
                frequency_penalty: 3.0,
                ..Default::default()
            },
            "frequency_penalty",
        ),
        (
            SamplingParams {
                presence_penalty: -2.5,
                ..Default::default()
            },
            "presence_penalty",
        ),
        (
            SamplingParams {
                stop_strings: vec![String::new()],
                ..Default::default()
            },
            "stop_strings",
        ),
    ];
    for (p, field) in cases {
        match Sampler::new(p, 0) {
            Err(ModelError::InvalidSampling { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: expected InvalidSampling, got {other:?}"),
        }
    }
}

#[test]
fn stop_tokens_and_strings() {
    let p = SamplingParams {
        stop_token_ids: vec![9],
        stop_strings: vec!["\n\n".into(), "END".into()],
        ..Default::default()
    };
    assert_eq!(check_stop(&p, &[2], 9, "x"), Some(StopReason::Token(9)));
    assert_eq!(check_stop(&p, &[2], 2, "x"), Some(StopReason::Token(2)));
    assert_eq!(check_stop(&p, &[2], 5, "hello"), None);
    assert_eq!(
        check_stop(&p, &[2], 5, "abc END x\n\n"),
        Some(StopReason::String {
            matched: "END".into(),
            at: 4
        })
    );
    assert_eq!(stop_string_holdback(&p, "text EN"), 2);
    assert_eq!(stop_string_holdback(&p, "para\n"), 1);
    assert_eq!(stop_string_holdback(&p, "plain"), 0);
}

#[test]
fn tiny_preset_generates_deterministically() {
    let run = || {
        let backend = CpuBackend::default();
        let model = tiny_model(&backend).unwrap();
        let layout = KvLayout::new(tiny_config().kv_shape(KvDtype::F32).unwrap(), 16, 256).unwrap();
        let mut runner = ModelRunner::new(backend, model, layout).unwrap();
        let tok = tiny_tokenizer();
        let mut seq = tok.encode("The quick brown fox", false).unwrap();
        let slots: Vec<Slot> = (0..64).map(|p| Slot(16 + p)).collect();
        let mut sampler = Sampler::new(
            SamplingParams {
                temperature: 0.8,
                top_k: Some(40),
                seed: Some(3),
                ..Default::default()
            },
            0,
        )
        .unwrap();
        let prompt_len = seq.len();
        let mut dec = IncrementalDecoder::new(true);
        let mut text = String::new();
        for step in 0..8 {
            let new = if step == 0 {
                &seq[..]
            } else {
                &seq[seq.len() - 1..]
            };
            let out = runner
                .forward(&ForwardInput {
                    mode: if step == 0 {
                        AttentionMode::Extend
                    } else {
                        AttentionMode::Decode
                    },
                    requests: vec![ForwardRequest {
                        input_ids: new,
                        slots: &slots[..seq.len()],
                    }],
                    logits: LogitsMode::LastToken,
                    layer_wait: None,
                })
                .unwrap();
            let t = sampler
                .sample(out.last(0).unwrap(), &seq[..prompt_len], &seq[prompt_len..])
                .unwrap();
            seq.push(t);
            text.push_str(&dec.step(&tok, t).unwrap());
        }
        text.push_str(&dec.finish(&tok).unwrap());
        (seq, text)
    };
    let (a, ta) = run();
    let (b, tb) = run();
    assert_eq!(a, b);
    assert_eq!(ta, tb);
    assert!(a.iter().all(|&t| (t as usize) < 50_257));
}

#[test]
fn tiny_preset_snapshot() {
    let cfg = tiny_config();
    let inventory = random_weights(&cfg, TINY_SEED).inventory();
    insta::assert_snapshot!(format!("{cfg}\n\n{inventory}"));
}
