//! Reads a chat request body for its model, as the gateway does for every request whose
//! path names no Azure deployment, a given number of times: what `bench/body.sh` counts the instructions of.
//!
//!     body_scan <prompt bytes> <plain | escapes | ja> <iterations>
//!
//! The user message is `prompt bytes` long: English prose with a line break after every
//! sentence (`plain`), text with an escape every few words (`escapes`), or Japanese
//! (`ja`, three bytes a character).

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(bytes), Some(text), Some(iterations)) = (
        args.first().and_then(|a| a.parse::<usize>().ok()),
        args.get(1),
        args.get(2).and_then(|a| a.parse::<usize>().ok()),
    ) else {
        eprintln!("usage: body_scan <prompt bytes> <plain | escapes | ja> <iterations>");
        return ExitCode::from(2);
    };
    let words: &[&str] = match text.as_str() {
        "plain" => &[
            "The quarterly report shows that revenue grew by twelve percent in the third quarter, ",
            "while costs stayed flat.\\n",
        ],
        "escapes" => &[
            "the ",
            "report\\n",
            "says \\\"growth\\\" ",
            "of ",
            "12% ",
            "in ",
            "Q3.\\t",
        ],
        "ja" => &[
            "四半期の",
            "報告書を",
            "三つの",
            "要点に",
            "まとめて",
            "ください。",
            "\\n",
        ],
        _ => {
            eprintln!("body_scan: the text is plain, escapes or ja, not {text}");
            return ExitCode::from(2);
        }
    };
    let mut prompt = String::new();
    for word in words.iter().cycle() {
        if prompt.len() >= bytes {
            break;
        }
        prompt.push_str(word);
    }
    let body = format!(
        r#"{{"model":"gpt-4o","messages":[{{"role":"system","content":"You are a helpful assistant."}},{{"role":"user","content":"{prompt}"}}],"max_tokens":700,"stream":false}}"#
    );
    let mut read = 0;
    for _ in 0..iterations {
        match spillgate_core::request::inspect_body(std::hint::black_box(body.as_bytes())) {
            Ok(info) if info.model.as_deref() == Some("gpt-4o") => read += 1,
            other => {
                eprintln!("body_scan: the model was not read: {other:?}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!("{} {read}", body.len());
    ExitCode::SUCCESS
}
